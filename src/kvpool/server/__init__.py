"""``kvpool serve``: a storage node hosting the DRAM arena and the SSD engine on the network."""
