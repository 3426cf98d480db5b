#!/usr/bin/env bash
# The test command: sets up .venv (see setup.sh) and runs the whole suite.
# Tests that need redis-server start their own on a free loopback port; they skip with a
# stated reason when the binary is missing (.ci/run installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest "$@"
