#!/usr/bin/env bash
# The run command: sets up .venv and runs the main job with embedded defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvbench tiers "$@"
