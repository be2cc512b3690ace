"""The storage-node wire protocol and its blocking client (DESIGN.md section 6)."""
