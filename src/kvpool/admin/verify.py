"""``kvpool admin verify DIR``: check an SSD segment directory offline (ssd/verify.py).

Exit 0 when it is clean, 1 when damage was found (a summary of what on stdout) or the
directory is held by a running pool, 2 when DIR is no kvpool SSD directory.

Keys: a record holds the key it was filed under. An engine's own pool files a chunk under its
chunk key, the key the client uses; a storage node files it under
``xxh3_128(namespace id ‖ chunk key)`` (server/store.py ``scoped_chunk_key``), which cannot be
turned back into the chunk key. So a bad record is named by its namespace id and filed key,
and ``--chunk-key HEX`` (repeatable) names the records of chunk keys a client uses, filed
either way.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from kvpool.admin.common import FAILED, OK, USAGE, AdminError, command, console, print_json
from kvpool.errors import CacheDirLockedError


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("verify", help="scan an SSD directory offline: records, bad records, "
                       "summaries")
    p.add_argument("dir", help="the SSD directory (<cache_dir>/ssd, or ssd.path); a cache_dir "
                   "holding an ssd/ directory is taken as that")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--chunk-key", metavar="HEX", action="append", default=[],
                   help="a chunk key a client uses (32 hex digits; repeatable): bad records "
                   "filed under it, by an engine's pool as it is or by a storage node as "
                   "xxh3_128(namespace id + key), are named by it")
    p.set_defaults(func=command(admin_verify))


def admin_verify(args: argparse.Namespace) -> int:
    from kvpool.ssd.verify import verify_directory
    path = Path(args.dir).expanduser()
    if not any(path.glob("seg-*.kvs")) and (path / "ssd").is_dir():
        path = path / "ssd"  # a cache_dir
    chunk_keys = _chunk_keys(args.chunk_key)
    # What the walk logs (stepped-over blocks) is in the report; keep stderr to errors.
    logging.getLogger("kvpool.ssd").setLevel(logging.ERROR)
    try:
        report = verify_directory(path)
    except CacheDirLockedError as exc:
        who = f"pid {exc.holder_pid}" if exc.holder_pid is not None else "pid unknown"
        raise AdminError(f"cannot verify {path}: a running kvpool SSD engine holds it "
                         f"({who}); stop that pool or node first: verify reads the directory "
                         "offline") from None
    except (FileNotFoundError, NotADirectoryError):
        raise AdminError(f"{path} is not a directory", USAGE) from None
    except ValueError as exc:
        raise AdminError(str(exc), USAGE) from None
    except OSError as exc:
        raise AdminError(f"cannot read {path}: {exc}") from None
    for s in report.segments:
        for bad in s.bad_records:
            name_chunk_key(bad, chunk_keys)
    if args.json:
        print_json(report.as_dict())
        return FAILED if report.damaged else OK
    from rich.table import Table
    table = Table(title=f"{path}: segments of {report.segment_size} bytes")
    for col in ("segment", "state", "good", "bad", "torn", "tombstones", "skipped blocks",
                "summary"):
        table.add_column(col, justify="right" if col != "summary" else "left")
    for s in report.segments:
        if s.state in ("free", "missing") and not s.damaged:
            continue
        table.add_row(str(s.number), s.state, *(str(v) for v in (
            s.good, s.bad, s.torn, s.tombstones, s.skipped_blocks)),
            s.summary + (f": {s.summary_detail}" if s.summary_detail else ""))
    out = console(120)
    out.print(table)
    t = report.totals()
    unnamed = False
    for s in report.segments:
        for bad in s.bad_records:
            if "chunk_key" in bad:
                what = f"chunk key {bad['chunk_key']}, {bad['filed_as']}"
            else:
                what = f"filed key {bad['key']}"
                unnamed = True
            out.print(f"segment {s.number}: record seq {bad['seq']} at offset "
                      f"{bad['offset']} (namespace {bad['namespace']}, {what}): "
                      f"{bad['problem']}")
    if unnamed:
        out.print("a filed key is the chunk key in an engine's own pool, and xxh3_128("
                  "namespace id + chunk key) on a storage node (one-way): --chunk-key HEX "
                  "names the records of a chunk key a client uses")
    verdict = "DAMAGED" if report.damaged else "clean"
    out.print(f"{verdict}: {t['used']} of {t['segments']} segments in use, {t['good']} good "
                  f"records, {t['bad']} bad, {t['torn']} torn, {t['skipped_blocks']} blocks "
                  f"between records that are not headers, {t['summary_mismatches']} summaries "
                  "that disagree with their records")
    return FAILED if report.damaged else OK


def _chunk_keys(values: list[str]) -> list[bytes]:
    """``--chunk-key`` values as keys; AdminError (usage) for one that is not 16 bytes of
    hex."""
    keys = []
    for value in values:
        try:
            key = bytes.fromhex(value)
        except ValueError:
            key = b""
        if len(key) != 16:
            raise AdminError(f"--chunk-key {value!r}: not a chunk key (32 hex digits)", USAGE)
        keys.append(key)
    return keys


def name_chunk_key(bad: dict[str, Any], chunk_keys: list[bytes]) -> None:
    """Add ``chunk_key`` and ``filed_as`` to a bad record's description (``key`` and
    ``namespace`` in hex) when it was filed under one of ``chunk_keys``: as it is (an
    engine's own pool) or scoped by its namespace (a storage node)."""
    from kvpool.server.store import scoped_chunk_key
    filed, ns_id = bytes.fromhex(bad["key"]), bytes.fromhex(bad["namespace"])
    for key in chunk_keys:
        if filed == key:
            bad.update(chunk_key=key.hex(), filed_as="filed as it is (an engine's pool)")
            return
        if filed == scoped_chunk_key(ns_id, key):
            bad.update(chunk_key=key.hex(), filed_as=f"filed by a storage node as {filed.hex()}")
            return
