"""deploy/container/Containerfile, linted without building it: a small parser of its
instructions, then the checks that keep it in step with the CLI, the default config, the
Kubernetes manifests and the repository (a flag, a port or a COPY source that drifted fails
here). No network, no podman. The last test builds the image (podman, on the mmdebstrap base
of scripts/image-base.sh, with the session's wheel) where the machine can, and skips saying
why where it cannot; KVPOOL_TEST_IMAGE_BUILD=1 makes it fail instead, =0 skips it
(docs/deploy.md#container-image)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import kvpool

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
BUILD_TOOLS = ("gcc", "g++", "clang", "build-essential", "python3-dev", "libc6-dev", "make",
               "cython", "setuptools", "wheel", "build")


@dataclass
class Instruction:
    """One instruction: its keyword (upper case), its flags (``--from=build``) and the rest."""

    keyword: str
    flags: dict[str, str]
    args: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse(text: str) -> tuple[list[Instruction], list[Stage]]:
    """Instructions before the first FROM, and the stages. Joins ``\\``-continued lines, drops
    comments; raises ValueError on an instruction it does not know."""
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "USER", "WORKDIR", "VOLUME", "EXPOSE",
             "HEALTHCHECK", "ENTRYPOINT", "CMD", "LABEL"}
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, "a continued line at the end of the file"
    preamble: list[Instruction] = []
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword not in known:
            raise ValueError(f"unknown instruction {keyword!r}")
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = value
            rest = rest.strip()
        ins = Instruction(keyword, flags, rest)
        if keyword == "FROM":
            words = rest.split()
            stage_name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], stage_name))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            preamble.append(ins)
    return preamble, stages


def exec_form(ins: Instruction) -> list[str]:
    value = json.loads(ins.args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), ins
    return value


@pytest.fixture(scope="module")
def parsed() -> tuple[list[Instruction], list[Stage]]:
    return parse(CONTAINERFILE.read_text())


def test_multi_stage_with_base_as_build_arg(parsed: tuple[list[Instruction], list[Stage]]) -> None:
    preamble, stages = parsed
    assert len(stages) >= 2, "a build stage and a final stage"
    base_args = [i.args for i in preamble if i.keyword == "ARG" and i.args.startswith("BASE=")]
    assert base_args == ["BASE=debian:bookworm-slim"]
    # every stage is on the base or on an earlier stage; the final one on the plain base
    names: list[str | None] = []
    for stage in stages:
        assert stage.base == "${BASE}" or stage.base in names, stage
        names.append(stage.name)
    assert stages[-1].base == "${BASE}"
    assert stages[-1].all("COPY") and any(c.flags.get("from") for c in stages[-1].all("COPY"))


def test_final_stage_runs_as_fixed_non_root_uid_matching_k8s(
        parsed: tuple[list[Instruction], list[Stage]]) -> None:
    final = parsed[1][-1]
    users = final.all("USER")
    assert users, "the final stage sets USER"
    uid = users[-1].args.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a fixed numeric, non-root uid"
    sts = yaml.safe_load((ROOT / "deploy/k8s/base/statefulset.yaml").read_text())
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)


def test_final_stage_installs_no_build_tools(parsed: tuple[list[Instruction], list[Stage]]) -> None:
    final = parsed[1][-1]
    for run in final.all("RUN"):
        words = set(re.split(r"[\s\"'=<>;&|()]+", run.args))
        assert not words & set(BUILD_TOOLS), f"build tool in the final stage: {run.args}"
        assert "pip" not in run.args, "the final stage copies the venv; it does not pip install"
    # The venv the final stage copies leaves pip behind in the stage it comes from.
    (venv_copy,) = [c for c in final.all("COPY") if "from" in c.flags]
    (source,) = [s for s in parsed[1] if s.name == venv_copy.flags["from"]]
    build_runs = " ".join(r.args for r in source.all("RUN"))
    assert "pip uninstall -y pip" in build_runs
    assert "--only-binary=:all:" in build_runs, "nothing compiled, even in the build stage"


def test_entrypoint_is_kvpool_and_cmd_flags_exist(
        parsed: tuple[list[Instruction], list[Stage]]) -> None:
    final = parsed[1][-1]
    assert exec_form(final.all("ENTRYPOINT")[-1]) == ["kvpool"]
    cmd = exec_form(final.all("CMD")[-1])
    assert cmd[0] == "serve"
    help_text = subprocess.run([sys.executable, "-m", "kvpool.cli", "serve", "--help"],
                               capture_output=True, text=True, timeout=60, check=True).stdout
    for flag in (a for a in cmd[1:] if a.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), flag
    # The config the CMD names is the one the image ships, and kvpool accepts it.
    config_path = cmd[cmd.index("--config") + 1]
    copies = {shlex.split(c.args)[-1]: shlex.split(c.args)[0] for c in final.all("COPY")}
    assert config_path in copies
    subprocess.run([sys.executable, "-m", "kvpool.cli", "config", "--config",
                    str(ROOT / copies[config_path])], capture_output=True, timeout=60, check=True)


def test_exposed_ports_match_config_and_k8s(parsed: tuple[list[Instruction], list[Stage]]) -> None:
    final = parsed[1][-1]
    exposed = {int(p.split("/")[0]) for e in final.all("EXPOSE") for p in e.args.split()}
    def ports(cfg: dict) -> set[int]:
        return {cfg["server"]["port"], cfg["server"]["metrics_port"],
                cfg["events"]["port"], cfg["events"]["replay_port"]}

    config = yaml.safe_load((ROOT / "deploy/container/node.yaml").read_text())
    assert exposed == ports(config)
    sts = yaml.safe_load((ROOT / "deploy/k8s/base/statefulset.yaml").read_text())
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert exposed == {p["containerPort"] for p in container["ports"]}
    k8s_config = yaml.safe_load((ROOT / "deploy/k8s/base/kvpool.yaml").read_text())
    assert exposed == ports(k8s_config)
    # The HEALTHCHECK probes the node's own /healthz on the metrics port, without curl.
    (check,) = final.all("HEALTHCHECK")
    assert check.args.startswith("CMD ")
    probe = json.loads(check.args[len("CMD "):])
    assert probe[0].startswith("python3") and "curl" not in check.args
    assert f"127.0.0.1:{config['server']['metrics_port']}/healthz" in probe[-1]


def test_every_copy_source_exists(parsed: tuple[list[Instruction], list[Stage]]) -> None:
    seen: list[str] = []
    for stage in parsed[1]:
        for copy in stage.all("COPY"):
            sources = shlex.split(copy.args)[:-1]
            if "from" in copy.flags:
                assert copy.flags["from"] in seen, f"COPY --from a later or unknown stage: {copy}"
                continue
            for src in sources:
                assert (ROOT / src).exists(), f"COPY source missing from the repo: {src}"
        if stage.name:
            seen.append(stage.name)


def test_parser_rejects_unknown_instruction() -> None:
    with pytest.raises(ValueError, match="ONBUILD"):
        parse("FROM x\nONBUILD RUN true\n")


#: "1": the image must build (a machine that cannot fails the test); "0": skip it; unset: build
#: where the machine can, else skip saying why.
IMAGE_BUILD = os.environ.get("KVPOOL_TEST_IMAGE_BUILD", "")


def cannot_build(reason: str) -> None:
    """Skip (or, with KVPOOL_TEST_IMAGE_BUILD=1, fail) the image build for ``reason``."""
    if IMAGE_BUILD == "1":
        pytest.fail(f"KVPOOL_TEST_IMAGE_BUILD=1, but the image cannot be built here: {reason}")
    pytest.skip(f"cannot build the container image here: {reason}")


def podman(*args: str, timeout: float = 120) -> str:
    """Run ``podman args``; its stdout, or AssertionError with its output."""
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"podman {' '.join(args)}: "
                                  f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return proc.stdout


def in_image(root: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in the image's filesystem as uid/gid 10001 with the image's PATH."""
    return subprocess.run(["chroot", "--userspec=10001:10001", root, "/usr/bin/env", "-i",
                           "PATH=/opt/kvpool/bin:/usr/local/bin:/usr/bin:/bin", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.image
@pytest.mark.pypi
def test_image_builds_and_its_kvpool_runs_as_uid_10001(built_dist: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    """Builds the image from the session's wheel on the mmdebstrap base of
    scripts/image-base.sh, checks its metadata and runs its kvpool from the image's
    filesystem as uid 10001 (``podman run`` cannot work in this sandbox: docs/deploy.md).
    The built image is removed afterwards; the base stays cached."""
    if IMAGE_BUILD == "0":
        pytest.skip("KVPOOL_TEST_IMAGE_BUILD=0")
    if os.geteuid() != 0:
        cannot_build("needs root (podman build with chroot isolation, mmdebstrap)")
    for tool in ("podman", "mmdebstrap", "chroot"):
        if not shutil.which(tool):
            cannot_build(f"no {tool} on PATH (scripts/system-deps.sh installs it as root)")
    base = subprocess.run(["bash", str(ROOT / "scripts" / "image-base.sh")],
                          capture_output=True, text=True, timeout=900)
    if base.returncode == 3:
        cannot_build(base.stderr.strip())
    assert base.returncode == 0, f"scripts/image-base.sh failed:\n{base.stderr[-4000:]}"
    base_image = base.stdout.strip()

    wheel, _ = built_dist  # the wheel test_packaging.py installs: it replaces the wheel stage
    (tmp_path / "wheel" / "wheels").mkdir(parents=True)
    shutil.copy2(wheel, tmp_path / "wheel" / "wheels" / wheel.name)
    tag = f"localhost/kvpool-test:{os.getpid()}"
    # chroot isolation: this sandbox's crun cannot create containers (docs/deploy.md);
    # --layers=false: no intermediate images are kept, so removing the tag frees everything.
    cmd = ["build", "--isolation=chroot", "--layers=false", "--format", "docker",
           "--build-arg", f"BASE={base_image}", "--build-context", f"wheel={tmp_path / 'wheel'}",
           "-f", str(CONTAINERFILE), "-t", tag]
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if ca.exists():
        cmd += ["-v", f"{ca}:/run/ca.crt:ro", "--build-arg", "PIP_CERT=/run/ca.crt"]
    before = set(podman("images", "-a", "-q", "--no-trunc").split())
    try:
        podman(*cmd, str(ROOT), timeout=900)
        (info,) = json.loads(podman("image", "inspect", tag))
        config = info["Config"]
        final = parse(CONTAINERFILE.read_text())[1][-1]
        assert config["User"] == final.all("USER")[-1].args
        assert config["Entrypoint"] == ["kvpool"]
        assert config["Cmd"] == exec_form(final.all("CMD")[-1])
        assert set(config["ExposedPorts"]) == {
            f"{p}/tcp" for e in final.all("EXPOSE") for p in e.args.split()}
        assert {"7450/tcp", "9450/tcp", "5557/tcp", "5558/tcp"} <= set(config["ExposedPorts"])
        (check,) = final.all("HEALTHCHECK")  # kept: a Docker-format image
        assert info["Healthcheck"]["Test"] == ["CMD", *json.loads(check.args[len("CMD "):])]
        mount = podman("image", "mount", tag).strip()
        try:
            root = Path(mount)
            assert not any((root / "usr/bin" / t).exists() for t in ("gcc", "cc", "make", "g++"))
            assert not (root / "opt/kvpool/bin/pip").exists()
            assert not (root / "src").exists() and not (root / "wheels").exists()
            version = in_image(mount, "kvpool", "--version")
            assert version.returncode == 0, version.stderr
            assert version.stdout.strip() == f"kvpool {kvpool.__version__}"
            # the shipped config, read by the installed kvpool with its dependencies
            shown = in_image(mount, "kvpool", "config", "--config", "/etc/kvpool/node.yaml")
            assert shown.returncode == 0, shown.stderr
            assert re.search(r"^\s*port: 7450$", shown.stdout, re.M), shown.stdout
        finally:
            podman("image", "unmount", tag)
    finally:
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, timeout=300)
    left = set(podman("images", "-a", "-q", "--no-trunc").split()) - before
    assert not left, f"the build left images behind: {left}"
