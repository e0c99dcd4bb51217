#!/usr/bin/env bash
# Installs what deepseek-fleet needs on a fresh Debian/Ubuntu machine with Python >= 3.10.
#   scripts/setup.sh          the engine (serve the embedded model)
#   scripts/setup.sh --dev    everything the test suite needs (engine, operator, oracles, redis-server, helm)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dev=0
[[ "${1:-}" == "--dev" ]] && dev=1

# torch first, pinned: anything that pulls torch later then finds it satisfied (the CPU build here)
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0

if [[ $dev == 1 ]]; then
  if ! command -v redis-server >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  "$PY" -m pip install -q --disable-pip-version-check -e '.[engine,operator,dev]'
  bash scripts/install-helm.sh
else
  "$PY" -m pip install -q --disable-pip-version-check -e '.[engine]'
fi
