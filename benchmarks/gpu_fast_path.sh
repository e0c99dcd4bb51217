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
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/engine/test_kernels.py tests/engine/test_fast_path.py \
  tests/engine/test_linear_fusion.py tests/engine/test_warm_up.py tests/engine/test_engine.py >"$OUT_DIR/tests.log" 2>&1
echo "tests: exit $?" ; tail -3 "$OUT_DIR/tests.log"
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
