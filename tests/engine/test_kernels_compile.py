"""Every fast-path kernel compiles for Hopper (sm_90) at DeepSeek's real shapes, without a GPU: the
interpreter-run kernel tests cannot see compile-only errors (a loop-carried variable changing type
passed them once and failed on the first GPU) or tiles over the chip's shared memory."""

import os
import subprocess
import sys
from pathlib import Path

KERNELS = {"_rms_norm_kernel", "_latent_write_kernel", "_write_absorb_kernel", "_gather_kernel", "_route_kernel",
           "_router_kernel", "_moe_gemm_kernel", "_swiglu_kernel",
           "_up_kernel", "_down_kernel", "_split_kernel", "_merge_kernel",
           "_prefill_kernel", "_draw_split_kernel",
           "_group_quant_kernel", "_block_gemm_kernel", "_gemv_kernel", "_sum_kernel", "_align_kernel",
           "_chunk_count_kernel", "_chunk_place_kernel",
           "_block_gemm_tma_kernel", "_moe_gemm_tma_kernel",
           "_dual_pool_kernel", "_sink_merge_kernel", "_indexer_kernel", "_compress_decode_kernel",
           "_norm_rope_kernel", "_hc_mix_kernel", "_up_fp4_words_kernel", "_down_fp4_words_kernel",
           "_dequant_kernel", "_greedy_kernel", "_decode_rows_kernel", "_accept_kernel", "_advance_kernel",
           "_noise_keys_kernel", "_nucleus_split_kernel", "_draw_finish_kernel", "_ws_prefill_kernel",
           "_ws_moe_gemm_kernel", "_tma_decode_kernel", "_fp8_decode_kernel", "_dot_kernel"}
PDL_KERNELS = {"_rms_norm_kernel", "_gemv_kernel", "_latent_write_kernel", "_write_absorb_kernel", "_split_kernel",
               "_merge_kernel", "_route_kernel", "_router_kernel", "_up_kernel", "_down_kernel",
               "_sum_kernel", "_greedy_kernel", "_tma_decode_kernel", "_fp8_decode_kernel", "_dot_kernel"}


def test_every_kernel_compiles_for_hopper_within_its_shared_memory():
    root = Path(__file__).parent.parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    proc = subprocess.run([sys.executable, "-m", "engine.tools.compile_kernels", "--arch", "90"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    compiled = {line.split()[0] for line in proc.stdout.splitlines() if "shared" in line}
    assert compiled == KERNELS, f"compiled {sorted(compiled)}"
    assert "over the limit" not in proc.stdout
    # the decode chain's kernels launch with programmatic dependent launch on Hopper, each one waiting
    # for its inputs in the compiled code (a launch that never waits is refused above)
    early = {line.split()[0] for line in proc.stdout.splitlines() if "'launch_pdl': True" in line}
    assert early == PDL_KERNELS, f"launched with PDL: {sorted(early)}"
    assert "never waits" not in proc.stdout
    # the Gluon kernels' partitions hold their registers without spilling (ptxas on their PTX)
    assert "spills" not in proc.stdout
    # the Gluon decode kernels ask L2 for their first tiles before they wait for the kernel ahead
    assert "asks L2 only after waiting" not in proc.stdout
