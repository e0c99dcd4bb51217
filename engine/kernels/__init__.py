"""Triton kernels of the GPU fast path; each module holds kernels, the launcher callers use, and a
plain-PyTorch reference the tests compare against.

| module | what |
|---|---|
| `mla_decode` | weight-absorbed MLA decode over the paged latent cache, split along the sequence (bf16 or FP8 cache) |
| `mla_prefill` | causal variable-length MLA prefill with a cached prefix (chunked prefill) |
| `moe_routing` | router scoring + group-limited top-k, and the sort of (token, expert) pairs by expert |
| `fused_moe` | grouped GEMMs over the sorted pairs, SiLU-and-multiply fused; bf16 and FP8 block-scaled |
| `moe_gemv` | the same experts for a handful of tokens as GEMVs over the pairs, without the sort |
| `fp8_gemm` | per-token-group activation quantization + FP8 block-scaled GEMM |
| `rms_norm` | RMSNorm, optionally fused with the residual add |
| `latent_cache` | kv norm, rope of the queries and the shared key, and the latent cache write (FP8: quantized) in one launch |
| `rotary` | the in-kernel rotation of query heads (interleaved rope) and its reference |
| `sampling` | temperature / greedy sampling on the GPU (Gumbel-max) |
| `spec_step` | a speculative step's bookkeeping: decode rows' cache slots, acceptance, the next step's rows |
| `mhc` | DeepSeek-V4's mHC site (weights, Sinkhorn, the collapse) and the mix after a sublayer |
| `compressed_decode` | DeepSeek-V4's decode attention over the window and compressed pools; the indexer's decode scores |
| `compressor` | DeepSeek-V4's compressor decode step (state, entry norm and rope, cache write) |
| `norm_rope` | DeepSeek-V4's RMSNorm (float32 weight) and interleaved RoPE, fused where both apply |

On Hopper and later the decode chain's kernels (norms, GEMVs, latent write, attention, routing, the MoE
GEMVs, greedy) launch with programmatic dependent launch: each starts during its predecessor's tail and
waits for its inputs where it first needs them (`_util.wait_for_inputs`); `_util.PDL = False` turns it off.

Kernels run compiled on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before the
first import of this package (how the tests run them without a GPU).
"""

import os


def runs_here(t) -> bool:
    """Whether the kernels can take tensor t: on CUDA, or anywhere under Triton's interpreter."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
