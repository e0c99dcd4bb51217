#!/usr/bin/env bash
# The GPU fast path on one GPU: kernel, fast-path, warm-up and engine tests (compiled), the GEMV tile
# sweeps, a decode layer's per-kernel profile, then the benchmark of both presets side by side with HF
# transformers. Results (JSON + PNG) and logs go to OUT_DIR
# (default benchmarks/results). Each stage has a time limit so one slow stage cannot starve the rest.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-benchmarks/results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# a limit a file: on an H100 (2026-12-05) test_kernels.py took 247 s and test_fast_path.py more than 340 s
for t in test_kernels:480 test_fast_path:900 test_linear_fusion:300 test_warm_up:300 test_engine:300; do
  timeout "${t#*:}" python3 -m pytest -q -rs -p no:cacheprovider "tests/engine/${t%%:*}.py" >"$OUT_DIR/tests-${t%%:*}.log" 2>&1
  echo "${t%%:*}: exit $?" ; tail -1 "$OUT_DIR/tests-${t%%:*}.log"
done
timeout 170 python3 benchmarks/moe_gemv_configs.py >"$OUT_DIR/moe-gemv-configs.log" 2>&1
echo "moe_gemv configs: exit $?" ; tail -10 "$OUT_DIR/moe-gemv-configs.log" | cut -c1-200
timeout 150 python3 benchmarks/gemv_configs.py >"$OUT_DIR/gemv-configs.log" 2>&1
echo "gemv configs: exit $?" ; cut -c1-200 "$OUT_DIR/gemv-configs.log"
for preset in v2-lite v3-slice; do
  timeout 90 python3 benchmarks/profile_layer.py --preset "$preset" >"$OUT_DIR/profile-$preset.log" 2>&1
  echo "profile $preset: exit $?" ; tail -3 "$OUT_DIR/profile-$preset.log"
done
timeout 260 python3 -m engine.bench --preset v2-lite --compare-hf --out "$OUT_DIR" >"$OUT_DIR/bench-v2-lite.log" 2>&1
echo "v2-lite: exit $?" ; tail -12 "$OUT_DIR/bench-v2-lite.log"
timeout 200 python3 -m engine.bench --preset v3-slice --compare-hf --out "$OUT_DIR" >"$OUT_DIR/bench-v3-slice.log" 2>&1
echo "v3-slice: exit $?" ; tail -12 "$OUT_DIR/bench-v3-slice.log"
