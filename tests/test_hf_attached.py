"""The HF integration attached to a host pool (``PrefixCache.open`` with ``host.socket``):
a prefix one process computed is restored by a second process attached to the same host
pool, with the greedy tokens of a plain recompute."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the hf extra (torch, transformers) is not installed")
pytest.importorskip("transformers")

from host_support import _env, engine_config, host_config, write_config
from test_hf import CHUNK_TOKENS, prompt, tiny_llama

from kvpool.config import config_from_dict
from kvpool.host.client import AttachedPool
from kvpool.host.server import HostServer
from kvpool.integrations.hf import PrefixCache

CHILD = Path(__file__).with_name("hf_child.py")


def test_a_prefix_one_process_computed_is_restored_by_another_attached_one(
        tmp_path: Path) -> None:
    data = host_config(tmp_path)
    server = HostServer(config_from_dict(data)).start()
    try:
        model = tiny_llama()
        ids = prompt(4 * CHUNK_TOKENS + 5)
        recompute = PrefixCache(model, None, CHUNK_TOKENS).generate(ids, 6).tokens
        first = PrefixCache.open(model, engine_config(data), chunk_tokens=CHUNK_TOKENS)
        try:
            assert isinstance(first.store, AttachedPool) and first.store.attached
            out = first.generate(ids, 6)
            assert out.prefill.cached_tokens == 0 and out.tokens == recompute
            first.flush()
            assert first.saved_chunks == 4
        finally:
            first.close()
        proc = subprocess.run(
            [sys.executable, str(CHILD), str(write_config(tmp_path, data, "engine.yaml")),
             str(len(ids)), "6"], capture_output=True, text=True, env=_env(), timeout=300,
            check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        second = json.loads(proc.stdout.strip().splitlines()[-1])
        assert second["restored"] == 4 * CHUNK_TOKENS  # the whole stored prefix
        assert second["tokens"] == second["recompute"] == recompute
    finally:
        server.stop()
