"""The monitor's reports (:func:`kvpool.monitor.report.endpoint_report`) as rich tables.

One table per endpoint, titled with the endpoint, its kind and its queues: a row per tier,
after an ``all`` row (overall hit rate and the pool's end-to-end latencies); below it a line
of what is not per tier (node requests and connections, nodes it sees down, engine figures).
A figure that is None prints as ``-``; a down endpoint is one line saying why. Rendering
never raises for a report's content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["render"]

_DASH = "-"
_COLUMNS = ("hit", "read/s", "write/s", "get p50/p99", "put p50/p99", "used", "evicted",
            "errors", "dropped")  # evicted, errors, dropped: counts over the interval


def render(reports: Mapping[str, Mapping[str, Any]], title: str) -> Group:
    """A heading (``title``) and one block per endpoint of ``reports`` (name -> report)."""
    blocks: list[RenderableType] = [Text(title, style="bold")]
    for endpoint, report in reports.items():
        if report.get("up"):
            blocks.append(_endpoint_table(endpoint, report))
        else:
            blocks.append(Text.assemble((f"{endpoint}  ", "bold"),
                                        ("MISSING" if report.get("missing") else "DOWN",
                                         "bold red"),
                                        f"  {report.get('error') or ''}"))
    return Group(*blocks)


def _endpoint_table(endpoint: str, report: Mapping[str, Any]) -> Table:
    queues = ", ".join(f"{q} {_count(v.get('depth'))} ({_bytes(v.get('bytes'))})"
                       for q, v in report.get("queues", {}).items())
    overall: Mapping[str, Any] = report.get("overall", {})
    table = Table(title=f"{endpoint}  [dim]{report.get('kind', '')}[/]  "
                  f"lookups/s {_num(overall.get('lookups_per_s'))}  "
                  f"queued: {queues or _DASH}",
                  title_justify="left", caption=_more(report), caption_justify="left",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    table.add_column("tier", no_wrap=True, min_width=len("ssd_staging"))
    for name in _COLUMNS:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_row("all", _pct(overall.get("hit_rate")), "", "", _pair(overall, "get"),
                  _pair(overall, "put"), "", "", _count(overall.get("remote_errors")), "")
    for tier, t in report.get("tiers", {}).items():
        table.add_row(tier, _pct(t.get("hit_rate")), _rate(t.get("read_gbps")),
                      _rate(t.get("write_gbps")), _pair(t, "get"), _pair(t, "put"), _used(t),
                      _count(t.get("evictions")), _count(t.get("errors")),
                      _count(t.get("dropped_saves")))
    return table


def _more(report: Mapping[str, Any]) -> str | None:
    parts: list[str] = []
    server = report.get("server")
    if server:
        parts += [f"requests/s {_num(server.get('requests_per_s'))}",
                  f"connections {_count(server.get('connections'))}",
                  f"request p50 / p99 {_latency(server.get('request_p50_s'))} / "
                  f"{_latency(server.get('request_p99_s'))}"]
        parts += [f"{label} {_count(server.get(key))}" for key, label in
                  (("auth_failures", "auth failures"), ("protocol_errors", "protocol errors"),
                   ("busy", "busy"))]
        if server.get("draining"):
            parts.append("[yellow]DRAINING[/]")
    seen: Mapping[str, bool] = report.get("nodes_seen", {})
    if seen:
        down = [node for node, up in seen.items() if not up]
        parts.append(f"nodes down: {', '.join(down)}" if down else
                     f"nodes: all {len(seen)} up")
    engine = report.get("engine")
    if engine:
        parts += [f"token hit {_pct(engine.get('token_hit_rate'))}",
                  f"prefill tokens saved {_count(engine.get('prefill_tokens_saved'))}",
                  f"TTFT p50 / p99 {_latency(engine.get('ttft_p50_s'))} / "
                  f"{_latency(engine.get('ttft_p99_s'))}"]
    return ", ".join(parts) or None


def _pct(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, float | int) else _DASH


def _num(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, float | int) else _DASH


def _count(value: Any) -> str:
    return f"{value:.0f}" if isinstance(value, float | int) else _DASH


def _bytes(value: Any) -> str:
    if not isinstance(value, float | int):
        return _DASH
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _rate(gbps: Any) -> str:
    """GB/s (10^9 bytes) in the most readable decimal unit per second."""
    if not isinstance(gbps, float | int):
        return _DASH
    for unit, scale in (("GB/s", 1.0), ("MB/s", 1e-3), ("kB/s", 1e-6)):
        if gbps >= scale:
            return _short(gbps / scale) + unit
    return f"{gbps * 1e9:.0f}B/s"


def _latency(seconds: Any) -> str:
    if not isinstance(seconds, float | int):
        return _DASH
    if seconds >= 1:
        return _short(seconds) + "s"
    if seconds >= 1e-3:
        return _short(seconds * 1e3) + "ms"
    return f"{seconds * 1e6:.0f}µs"


def _short(value: float) -> str:
    """Three significant digits or so, never an exponent."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _pair(figures: Mapping[str, Any], op: str) -> str:
    p50, p99 = figures.get(f"{op}_p50_s"), figures.get(f"{op}_p99_s")
    if p50 is None and p99 is None:
        return _DASH
    return f"{_latency(p50)}/{_latency(p99)}"


def _used(tier: Mapping[str, Any]) -> str:
    fraction, used = tier.get("used_fraction"), tier.get("used_bytes")
    if fraction is None:
        return _bytes(used) if used else _DASH
    return f"{_pct(fraction)} of {_bytes(tier.get('capacity_bytes')).replace(' ', '')}"
