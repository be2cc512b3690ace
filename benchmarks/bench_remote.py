"""Thin wrapper: ``python benchmarks/bench_remote.py [--quick] [--json PATH]``
runs the same code as ``kvpool bench remote`` (src/kvpool/bench/remote.py)."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from kvpool.bench.remote import main
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from kvpool.bench.remote import main

if __name__ == "__main__":
    sys.exit(main())
