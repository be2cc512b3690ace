"""deploy/systemd/kvpool-serve.service does what it says with the kvpool it starts: every
flag of its ExecStart is one ``kvpool serve`` has, its example node.yaml loads, its
ExecReload signal reloads a running node and its KillSignal stops it gracefully with exit 0
well inside TimeoutStopSec, a config error exits with the status RestartPreventExitStatus
names, and ``systemd-analyze verify`` (where installed) reports nothing.

The node here runs the unit's own command line (its executable swapped for this checkout's
``python -m kvpool.cli`` and its config for a small one in tmp), so a unit naming a flag or
a signal kvpool lacks fails here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kvtest import ServeProcess
from node_process import node_config

from kvpool.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "kvpool-serve.service"
NODE_YAML = ROOT / "deploy" / "systemd" / "node.yaml"


def unit_settings(path: Path = UNIT) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values (a key may repeat), comments and blank lines skipped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"{path}: key before a section: {line}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service(key: str) -> str:
    (value,) = unit_settings()["Service"][key]
    return value


def seconds(value: str) -> float:
    """A systemd time span of the forms this unit uses: ``45``, ``45s``, ``2min``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min)?", value)
    assert m, value
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def kvpool_cmd() -> list[str]:
    return [sys.executable, "-m", "kvpool.cli"]


def exec_start_args() -> list[str]:
    """ExecStart's arguments after the kvpool executable."""
    argv = shlex.split(service("ExecStart"))
    assert Path(argv[0]).name == "kvpool", argv
    return argv[1:]


def test_exec_start_flags_are_kvpool_serve_flags() -> None:
    args = exec_start_args()
    assert args[0] == "serve"
    help_text = subprocess.run([*kvpool_cmd(), "serve", "--help"], check=True,
                               capture_output=True, text=True, timeout=60).stdout
    flags = [a.split("=")[0] for a in args if a.startswith("-")]
    assert flags, args
    for flag in flags:
        assert re.search(rf"(^|\s|\[){re.escape(flag)}\b", help_text), \
            f"{flag} is not a kvpool serve flag:\n{help_text}"


def test_example_node_yaml_loads_and_fits_the_stop_timeout() -> None:
    cfg = load_config(str(NODE_YAML))
    assert cfg.server.node_id and cfg.server.metrics_port
    stop = seconds(service("TimeoutStopSec"))
    assert stop > cfg.server.shutdown_timeout_s
    assert stop > Config().server.shutdown_timeout_s  # the default too
    assert "--config" in exec_start_args()


def test_restart_policy_names_serves_config_error_status(tmp_path: Path) -> None:
    """RestartPreventExitStatus is what ``kvpool serve`` exits with for a bad setting."""
    assert service("Restart") == "on-failure"
    bad = tmp_path / "node.yaml"
    bad.write_text("server: {port: not-a-port}\n")
    proc = subprocess.run([*kvpool_cmd(), "serve", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert str(proc.returncode) in service("RestartPreventExitStatus").split()
    assert proc.returncode != 0


def _signal_of(value: str) -> signal.Signals:
    name = value if value.startswith("SIG") else f"SIG{value}"
    return signal.Signals[name]


def test_reload_and_stop_signals_act_on_a_running_node(tmp_path: Path) -> None:
    reload_argv = shlex.split(service("ExecReload"))
    assert reload_argv[0] == "/bin/kill" and reload_argv[-1] == "$MAINPID", reload_argv
    reload_sig = _signal_of(reload_argv[1].lstrip("-"))
    stop_sig = _signal_of(service("KillSignal"))
    timeout_stop = seconds(service("TimeoutStopSec"))

    config = tmp_path / "node.yaml"
    cfg = node_config(tmp_path)
    cfg["server"]["shutdown_timeout_s"] = 5
    config.write_text(yaml.safe_dump(cfg))
    args = exec_start_args()
    args[args.index("--config") + 1] = str(config)
    with ServeProcess([*kvpool_cmd(), *args], stderr=subprocess.STDOUT,
                      env={**os.environ, "KVPOOL_CONFIG": ""}) as node:
        node.wait_line("listening on")
        cfg["server"]["idle_timeout_s"] = 123.0  # a live setting
        config.write_text(yaml.safe_dump(cfg))
        os.kill(node.proc.pid, reload_sig)
        node.wait_line("config reloaded: applied")
        os.kill(node.proc.pid, stop_sig)
        assert node.proc.wait(timeout=timeout_stop) == 0, node.lines


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    """The unit as installed, with ExecStart pointing at a kvpool that exists here (verify
    checks the executable)."""
    kvpool_exe = Path(sys.executable).parent / "kvpool"
    if not kvpool_exe.exists():
        kvpool_exe = tmp_path / "kvpool"
        kvpool_exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m kvpool.cli \"$@\"\n")
        kvpool_exe.chmod(0o755)
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={kvpool_exe}", UNIT.read_text(), flags=re.M)
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
