"""The modes the demo compares (torch-free, so the CLI can list them cheaply)."""

MODES = ("recompute", "kvpool", "kvpool-ssd", "file-per-chunk")
MODE_HELP = {
    "recompute": "no cache: every prompt is prefilled in full",
    "kvpool": "embedded pool: DRAM arena, then the SSD engine",
    "kvpool-ssd": "DRAM tier off: every hit is an O_DIRECT read from the SSD engine",
    "file-per-chunk": "one file per chunk, page cache dropped before each request",
}
