#!/usr/bin/env bash
# The MXFP4 MoE GEMV's decodes on one GPU: every decode and tile against the float32 math of V4 Flash's
# experts and timed at 1, 2 and 8 tokens, where prefill batches should leave the GEMV (8, 32, 64, 128 tokens),
# then the MXFP4 kernel tests compiled. Results and logs go to OUT_DIR (default benchmarks/results); each
# stage has a time limit so one slow stage cannot starve the other.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-benchmarks/results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv >"$OUT_DIR/gpu.txt" 2>&1
timeout 240 python3 benchmarks/v4_quant_kernels.py --sections gemv,threshold --out "$OUT_DIR" \
  >"$OUT_DIR/v4-quant-kernels.log" 2>"$OUT_DIR/v4-quant-kernels.err"
echo "v4_quant_kernels: exit $?" ; cut -c1-160 "$OUT_DIR/v4-quant-kernels.log"
timeout 50 python3 -m pytest -q -rs -p no:cacheprovider tests/engine/test_kernels.py -k mxfp4 >"$OUT_DIR/tests.log" 2>&1
echo "mxfp4 tests: exit $?" ; tail -3 "$OUT_DIR/tests.log"
