"""An HF engine process attached to a host pool, for tests/test_hf_attached.py. Run as
``python tests/hf_child.py CONFIG.yaml PROMPT_TOKENS NEW_TOKENS``; prints one JSON line: the
greedy tokens through ``PrefixCache.open(config)`` (attached when the config names a host
socket), the prompt tokens it restored from the pool, and the tokens of a plain recompute."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from test_hf import CHUNK_TOKENS, prompt, tiny_llama

from kvpool.config import config_from_dict
from kvpool.integrations.hf import PrefixCache


def main(config_path: str, prompt_tokens: str, new_tokens: str) -> int:
    cfg = config_from_dict(yaml.safe_load(Path(config_path).read_text()))
    model = tiny_llama()
    ids = prompt(int(prompt_tokens))
    recompute = PrefixCache(model, None, CHUNK_TOKENS).generate(ids, int(new_tokens))
    cache = PrefixCache.open(model, cfg, chunk_tokens=CHUNK_TOKENS)
    try:
        out = cache.generate(ids, int(new_tokens))
    finally:
        cache.close()
    print(json.dumps({"tokens": out.tokens, "restored": out.prefill.cached_tokens,
                      "recompute": recompute.tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
