"""Fixtures for the vLLM tests: the pinned vLLM venv, a tiny model, and an engine runner.

vLLM is not installed in the test venv: engines run in subprocesses with ``.venv-vllm``'s
python (``kvpool.integrations.vllm.run_engine``), created by ``scripts/vllm-env.sh`` if
missing. Every cache vLLM or torch writes is redirected into the session's temp dir.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from engine_support import BLOCK, P1, P2, EngineProcess, EngineRunner, EngineStarter, Q

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's python; builds the venv (about 2 minutes) if it is missing."""
    subprocess.run(["bash", str(ROOT / "scripts" / "vllm-env.sh")], check=True)
    return VLLM_VENV / "bin" / "python"


@pytest.fixture(scope="session")
def vllm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-home")


@pytest.fixture(scope="session")
def tiny_model(vllm_home: Path) -> Path:
    """Random-weight Llama (vocab 4096, hidden 256, 4 layers, 4 heads, 2 KV heads) and a
    locally trained tokenizer, fp32 on disk; vLLM serves it in bf16."""
    from kvpool.integrations.models.tiny_llama import build_tiny_llama

    return build_tiny_llama(vllm_home / "tiny-llama")




@pytest.fixture(scope="session")
def start_engine(vllm_python: Path, vllm_home: Path) -> EngineStarter:
    """``start_engine(spec, multiprocess=False)`` starts one engine (see run_engine.py for the
    spec) in the background; ``.result()`` waits and returns its JSON result, failing the
    test with vLLM's stderr on an error."""
    counter = iter(range(1_000_000))

    def start(spec: dict[str, Any], multiprocess: bool = False) -> EngineProcess:
        n = next(counter)
        work = vllm_home / f"run{n}"
        (work / "rpc").mkdir(parents=True)
        env = dict(os.environ)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
            "VLLM_CACHE_ROOT": str(vllm_home / "vllm-cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(vllm_home / "inductor"),  # warm across runs
            "HF_HOME": str(vllm_home / "hf"),
            "HF_HUB_OFFLINE": "1",
            "VLLM_RPC_BASE_PATH": str(work / "rpc"),
            "VLLM_LOGGING_LEVEL": "WARNING",
        })
        env.pop("KVPOOL_CONFIG", None)
        spec_path, out_path = work / "spec.json", work / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.Popen(
            [str(vllm_python), "-m", "kvpool.integrations.vllm.run_engine", str(spec_path),
             str(out_path)], env=env, cwd=work, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        return EngineProcess(proc, out_path, n)

    return start


@pytest.fixture(scope="session")
def run_engine(start_engine: EngineStarter) -> EngineRunner:
    """``run_engine(spec, multiprocess=False)`` runs one engine to completion and returns
    its JSON result."""

    def run(spec: dict[str, Any], multiprocess: bool = False) -> dict[str, Any]:
        return start_engine(spec, multiprocess).result()

    return run


@pytest.fixture(scope="session")
def baseline(run_engine: EngineRunner, tiny_model: Path) -> dict[str, Any]:
    return run_engine({"model": str(tiny_model), "prompts": [P1, P2, Q], "max_tokens": 8,
                       "logprobs": 1, "block_size": BLOCK, "max_model_len": 2048})
