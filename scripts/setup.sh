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
  # redis-server for the KV directory tests; the verbs, NUMA and curl libraries Mooncake's transfer
  # engine links against (its RDMA transport is tested over Mooncake's own TCP protocol: no NIC here)
  export DEBIAN_FRONTEND=noninteractive
  if ! command -v redis-server >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  if ! ldconfig -p | grep -q libibverbs.so.1; then  # without them the Mooncake tests skip, nothing else
    apt-get install -y -qq libibverbs1 libnuma1 libcurl4 >/dev/null || echo "warning: Mooncake's libraries not installed"
  fi
  "$PY" -m pip install -q --disable-pip-version-check -e '.[engine,operator,dev]'
  # the CPU build of the `rdma` extra's transfer engine (the CUDA build needs a GPU driver to load)
  "$PY" -m pip install -q --disable-pip-version-check mooncake-transfer-engine-non-cuda==0.3.13.post1
  bash scripts/install-helm.sh
else
  "$PY" -m pip install -q --disable-pip-version-check -e '.[engine]'
fi
