#!/usr/bin/env bash
# The run command: sets up .venv and runs the main job, the sidecar daemon, with embedded
# defaults (loopback 127.0.0.1:50051, host RAM + a data directory under ~/.cache/kvstore).
# Extra arguments go to `kvstore serve` (e.g. --host-bytes 8GiB --metrics 127.0.0.1:9400).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh run
exec .venv/bin/kvstore serve "$@"
