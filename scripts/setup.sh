#!/usr/bin/env bash
# Creates .venv and installs the project with its test extras. Idempotent: a second run is quick.
# torch is pinned to the CPU build first so that no resolver pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test,redis]" 2>&1 | grep -v '^WARNING: Location' || true
  .venv/bin/python -c "import torch, kvstore, tiers" 
  rm -f .venv/.installed-*
  touch "$stamp"
fi
