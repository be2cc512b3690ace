"""``kvpool`` command line: ``kvpool --version``, ``kvpool bench storage``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpool import __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvpool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks beside their references")
    bench_sub = bench.add_subparsers(dest="suite", required=True)
    storage = bench_sub.add_parser("storage", help="DRAM arena and SSD engine vs memcpy, "
                                   "raw O_DIRECT and a file-per-chunk store")
    from kvpool.bench import storage as storage_bench
    storage_bench.add_arguments(storage)
    storage.set_defaults(func=storage_bench.run_from_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
