#!/usr/bin/env bash
# Creates .venv and installs the project. Idempotent: a second run only checks a stamp.
#   setup.sh run    the runtime only: the project and its redis extra (what `kvstore serve` needs)
#   setup.sh test   the runtime plus the test extras (transformers, hypothesis, triton, ...)
#   setup.sh vllm   real vLLM (CPU) and the project in a venv of their own, .venv-vllm (setup_vllm.sh)
# KVSTORE_FRESH_VENV=1 removes .venv first (CI does), so a resolver change shows at once.
# torch is pinned to the CPU build first so that no resolver pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-test}
case "$mode" in
  run) extras="redis" ;;
  test) extras="test,redis" ;;
  vllm) exec bash scripts/setup_vllm.sh ;;
  *) echo "usage: scripts/setup.sh [run|test|vllm]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if [ "${KVSTORE_FRESH_VENV:-0}" = 1 ]; then
  echo "setup: removing .venv for a fresh install" >&2
  rm -rf .venv
fi
hash=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
stamp=.venv/.installed-$mode-$hash
# a test install holds everything a run install does
if [ -f "$stamp" ] || { [ "$mode" = run ] && [ -f ".venv/.installed-test-$hash" ]; }; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
pip() {  # pip's own progress lines, without its noise about script locations
  { .venv/bin/pip install --disable-pip-version-check --progress-bar off "$@" 2>&1; } \
    | { grep -v -e '^WARNING: Location' -e '^Requirement already satisfied' || true; } >&2
}
echo "setup: installing torch==${TORCH_VERSION:-2.13.0} (CPU build)" >&2
pip "torch==${TORCH_VERSION:-2.13.0}"
echo "setup: installing kvstore with extras [$extras]" >&2
pip -e ".[$extras]"
.venv/bin/python -c "import torch, kvstore, tiers"
# Our top-level `kernels/` must be what `import kernels` finds from anywhere, not a
# dependency's module of the same name (Hugging Face's `kernels` once came with transformers).
if ! found=$(cd / && "$OLDPWD/.venv/bin/python" -c "import kernels, sys; sys.stdout.write(kernels.__file__ or '')") \
   || [ "$found" != "$PWD/kernels/__init__.py" ]; then
  echo "setup: 'import kernels' finds ${found:-nothing}, not this project's kernels/." >&2
  echo "setup: a dependency installed a module of the same name; see the pin in pyproject.toml." >&2
  exit 1
fi
.venv/bin/pip freeze --disable-pip-version-check 2>/dev/null \
  | grep -iE '^(torch|transformers|triton|grpcio|numpy|protobuf)==' | tr '\n' ' ' | sed 's/^/setup: resolved /; s/ $/\n/' >&2
rm -f .venv/.installed-*
touch "$stamp"
echo "setup: done ($mode)" >&2
