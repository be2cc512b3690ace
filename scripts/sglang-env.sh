#!/usr/bin/env bash
# Create (or reuse) the lean venv that runs kvpool's SGLang HiCache backend against SGLang's
# real host pool and cache controller: torch + sglang pinned exactly (its pool and controller
# constructors change between releases), sglang installed --no-deps with only the light
# dependencies its mem_cache code imports (the full install is ~11 GB of serving extras), then
# kvpool editable on top. Idempotent: a stamp file records what was installed, so a second run
# with the same pins returns at once. A failed install leaves no stamp and exits non-zero; the
# next run starts again from a fresh venv.
#
#   bash scripts/sglang-env.sh            # creates ./.venv-sglang
#   SGLANG_VENV=/path/to/venv bash scripts/sglang-env.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SGLANG_VENV:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
TORCH_SPECS=(torch==2.14.1 torchvision==0.29.1)
SGLANG_SPEC="sglang==0.5.23"
# What sglang's mem_cache, managers and server_args import, pinned where the release needs it.
SGLANG_DEPS=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
    pyzmq tqdm IPython aiohttp transformers==5.19.0 tokenizers==0.23.2 dill
    apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 gguf triton compressed-tensors==0.18.0)
KVPOOL_DEPS=(numpy xxhash pydantic PyYAML rich prometheus-client uvloop)
STAMP="$VENV/.kvpool-sglang-installed"
WANT="torch=${TORCH_SPECS[*]} spec=$SGLANG_SPEC deps=${SGLANG_DEPS[*]} kvpool=${KVPOOL_DEPS[*]} root=$ROOT format=1"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

echo "sglang-env: building $VENV ($SGLANG_SPEC, about 2 minutes)" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# pip warns once per package about local index paths that do not exist here, and (sglang
# being installed --no-deps on purpose) lists every serving dependency left out; hide only those.
pip_q() {
    "$VENV/bin/python" -m pip --quiet "$@" 2>&1 \
        | { grep -v -e "^WARNING: Location '.*' is ignored" -e "^sglang .* requires .*, which is not installed" \
                    -e "^ERROR: pip's dependency resolver does not currently take into account" || true; }
}
pip_q install --upgrade pip
pip_q install "${TORCH_SPECS[@]}"
pip_q install --no-deps "$SGLANG_SPEC"
pip_q install "${SGLANG_DEPS[@]}"
pip_q install "${KVPOOL_DEPS[@]}"
pip_q install --no-deps -e "$ROOT"
"$VENV/bin/python" -W ignore -c "
import sglang, kvpool.integrations.sglang
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
print('sglang', sglang.__version__)" >&2
echo "$WANT" > "$STAMP"
