"""Compile every Triton kernel of the fast path for a GPU architecture, on a machine without a GPU.

    python -m engine.tools.compile_kernels [--arch 90]

Triton's interpreter (the CPU kernel tests) runs a kernel's Python, not its compilation: a type error
that only the compiler sees, or a tile that needs more shared memory than the chip has, passes there
and fails on the first GPU. Here every launcher runs on CPU tensors of DeepSeek-V2-Lite's (bf16) and
DeepSeek-V3's (FP8) real shapes with the GPU's choices (tiles, no interpreter workarounds); each
kernel launch is caught and compiled for the target instead (through PTX to a cubin, with Triton's
own ptxas), and its shared memory checked against the architecture's per-block limit. Weights keep
their real rows and columns; expert counts are cut, since they change no compiled code. For sm_90 the
Gluon kernels (Hopper's only) are compiled too, at the engine's constants.
"""

import argparse
import contextlib
import importlib
import itertools
import sys
from collections.abc import Callable, Iterator
from unittest import mock

import torch

KERNEL_MODULES = ["activation", "compressed_decode", "compressor", "fp8_gemm", "mhc", "norm_rope", "fused_moe", "gemv", "latent_cache", "mla_decode", "mla_prefill", "moe_gemv", "moe_routing", "mxfp4",
                  "rms_norm", "rotary", "sampling", "spec_step"]
# largest shared memory one block may use, by compute capability (bytes)
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}


def _signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """Launch arguments -> (signature, constexprs, compile options, attrs) for triton.compile. The attrs
    are what Triton's launcher tells the compiler (16-byte-aligned tensors, integers divisible by 16,
    except arguments marked do_not_specialize), so the compiled code is the GPU's: vectorized loads."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        if type(value).__name__ == "TensorDescriptor":  # a TMA descriptor: its element type and tile
            signature[param.name] = f"tensordesc<{_TYPES[value.base.dtype]}{list(value.block_shape)}>"
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name], divisible = "*" + _TYPES[value.dtype], True  # 16-byte aligned
        elif isinstance(value, bool):
            signature[param.name], divisible = "i1", False
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            divisible = value != 0 and value % 16 == 0
        elif isinstance(value, float):
            signature[param.name], divisible = "fp32", False
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {param.name}={value!r}")
        if divisible and not param.do_not_specialize:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, options, attrs


class _Compiler:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` compiles instead of launching."""

    def __init__(self, kernel, arch: int, results: list):
        self.kernel, self.arch, self.results = kernel, arch, results

    def __getitem__(self, grid) -> Callable[..., None]:
        def compile_launch(*args, **kwargs) -> None:
            import triton
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource

            signature, constexprs, options, attrs = _signature(self.kernel, args, dict(kwargs))
            key = (self.kernel.__name__, tuple(sorted((k, str(v)) for k, v in constexprs.items())),
                   tuple(sorted(signature.items())), tuple(sorted(options.items())))
            if any(r["key"] == key for r in self.results):
                return
            compiled = triton.compile(ASTSource(self.kernel, signature, constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", self.arch, 32), options=options)
            # a kernel launched with programmatic dependent launch must wait for its inputs (`wait_for_inputs`)
            self.results.append(dict(key=key, kernel=self.kernel.__name__, shared=compiled.metadata.shared,
                                     constexprs=constexprs, options=options,
                                     waits="griddepcontrol.wait" in compiled.asm["ptx"]))

        return compile_launch


@contextlib.contextmanager
def compiling_for(arch: int, results: list) -> Iterator[None]:
    """Inside, kernel launches compile for `arch` and the launchers take their GPU choices."""
    from engine.kernels import _util

    modules = [importlib.import_module(f"engine.kernels.{name}") for name in KERNEL_MODULES]
    with contextlib.ExitStack() as stack:
        for module in [_util, *modules]:
            if hasattr(module, "interpreted"):
                stack.enter_context(mock.patch.object(module, "interpreted", lambda t: False))
            if hasattr(module, "pdl"):  # launched as on Hopper: programmatic dependent launch
                stack.enter_context(mock.patch.object(module, "pdl", lambda t: True))
            if hasattr(module, "shared_memory"):  # tiles chosen by the chip's shared memory: the target's
                stack.enter_context(mock.patch.object(module, "shared_memory", lambda d: SHARED_LIMIT[arch]))
        for module in modules:
            for name, obj in vars(module).items():
                if name.startswith("_") and name.endswith("_kernel"):
                    stack.enter_context(mock.patch.object(module, name, _Compiler(obj, arch, results)))
        yield


def _empty(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def launch_all() -> None:
    """Every launcher at V2-Lite's bf16 and V3's FP8 shapes, at decode and prefill sizes; V4's decode
    attention at V4 Flash's."""
    from engine.kernels.activation import silu_and_mul
    from engine.kernels.fp8_gemm import FP8, fp8_block_gemm_tma, fp8_linear, per_token_group_quant
    from engine.kernels.fused_moe import HALF_TMA_CONFIG, TMA_CONFIGS, fused_experts, fused_experts_tma
    from engine.kernels.gemv import gemv
    from engine.kernels.latent_cache import gather_latent, write_latent_, write_latent_absorbed_
    from engine.kernels.mla_decode import mla_decode_attention
    from engine.kernels.mla_prefill import mla_prefill_attention
    from engine.kernels.moe_gemv import SharedExperts, moe_gemv
    from engine.kernels.moe_routing import route, route_tokens
    from engine.kernels.rms_norm import rms_norm
    from engine.kernels.sampling import greedy, noise_keys, sample
    from engine.layers.fp8_latent import FP8LatentLayout

    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    for hidden, heads, experts, top_k, inter, shared, vocab, fp8 in ((2048, 16, 64, 6, 1408, 2, 102400, False),
                                                                     (7168, 128, 256, 8, 2048, 1, 129280, True)):
        lora, rope, nope, vdim, page, block = 512, 64, 128, 128, 64, (128, 128)
        for tokens in (1, 64, 4096):
            x = _empty(tokens, hidden)
            silu_and_mul(_empty(tokens, 2 * inter * shared))  # shared experts' (and dense layers') activation
            rms_norm(x, _empty(hidden), 1e-6, _empty(tokens, hidden))
            rms_norm(_empty(tokens, lora + rope)[:, :lora], _empty(lora), 1e-6)
            q = _empty(tokens, heads, nope + rope)
            kv = _empty(tokens, lora + rope)
            cos = sin = _empty(4096, rope // 2, dtype=f32)
            pos = torch.zeros(tokens, dtype=i64)
            write_latent_(_empty(64, page, lora + rope), kv, _empty(lora), 1e-6, q[..., nope:], pos, cos, sin, pos)
            fp8_row = FP8LatentLayout(lora, rope, torch.bfloat16).token_bytes  # --kv-cache-dtype fp8
            write_latent_(_empty(64, page, fp8_row, dtype=torch.uint8), kv, _empty(lora), 1e-6, q[..., nope:], pos,
                          cos, sin, pos)
            if tokens == 1:  # one decoding token's write with its query absorption
                for cache in (_empty(64, page, lora + rope), _empty(64, page, fp8_row, dtype=torch.uint8)):
                    write_latent_absorbed_(cache, kv, _empty(lora), 1e-6, q[..., :nope], q[..., nope:], pos, cos,
                                           sin, pos, _empty(heads * lora, nope))
            if tokens > 1:  # the prefill paths' read of an FP8 cache
                gather_latent(_empty(64, page, fp8_row, dtype=torch.uint8), pos, lora, rope, torch.bfloat16)
            ids = torch.randint(0, experts, (tokens, experts)).argsort(-1)[:, :top_k].to(i32).contiguous()
            route(_empty(tokens, experts, dtype=f32), _empty(experts, dtype=f32) if fp8 else None, top_k,
                  "sigmoid" if fp8 else "softmax", "noaux_tc" if fp8 else "group_limited_greedy", 8,
                  4 if fp8 else 3, fp8, 2.5)
            if tokens == 1:  # the router of a few tokens in one launch
                route_tokens(x, _empty(experts, hidden, dtype=f32), torch.zeros(8, dtype=i32),
                             _empty(experts, dtype=f32) if fp8 else None, top_k, "sigmoid" if fp8 else "softmax",
                             "noaux_tc" if fp8 else "group_limited_greedy", 8, 4 if fp8 else 3, fp8, 2.5)
            weights = _empty(tokens, top_k, dtype=f32)
            wdtype = FP8 if fp8 else torch.bfloat16
            ids = ids % 16  # sixteen experts stand in for all: the count changes no compiled code
            w13, w2 = _empty(16, 2 * inter, hidden, dtype=wdtype), _empty(16, hidden, inter, dtype=wdtype)
            scales = ((_empty(16, 2 * inter // 128, hidden // 128, dtype=f32),
                       _empty(16, hidden // 128, inter // 128, dtype=f32)) if fp8 else (None, None))
            fused_experts(x, w13, w2, weights, ids, *scales, block=block if fp8 else None)
            if tokens <= 8:
                sh = SharedExperts(_empty(2 * shared * inter, hidden, dtype=wdtype),
                                   _empty(hidden, shared * inter, dtype=wdtype),
                                   *((_empty(2 * shared * inter // 128, hidden // 128, dtype=f32),
                                      _empty(hidden // 128, shared * inter // 128, dtype=f32)) if fp8 else ()))
                moe_gemv(x, w13, w2, weights, ids, *scales, block=block if fp8 else None, shared=sh)
                if fp8:  # the products on the tensor cores
                    moe_gemv(x, w13, w2, weights, ids, *scales, block=block, shared=sh, dot=True)
                # the next layer's norm summing the slots moe_gemv hands on unsummed
                rms_norm(_empty(tokens, top_k + shared, hidden), _empty(hidden), 1e-6, _empty(tokens, hidden))
            if fp8:
                fp8_linear(x, _empty(1536, hidden, dtype=FP8), _empty(12, hidden // 128, dtype=f32), block)
            if fp8 and tokens == 4096:  # prefill: the persistent TMA kernels (chosen on the card by shape)
                xq, xs = per_token_group_quant(x, 128, k_major_scales=True)
                fp8_block_gemm_tma(xq, xs, _empty(1536, hidden, dtype=FP8), _empty(12, hidden // 128, dtype=f32), block,
                                   torch.bfloat16)
                for cfg in TMA_CONFIGS:
                    fused_experts_tma(x, w13, w2, weights, ids, *scales, block, cfg[1:])
            if not fp8 and tokens == 4096:  # bf16 experts' TMA kernels (chosen on the card by shape)
                fused_experts_tma(x, w13, w2, weights, ids, None, None, None, HALF_TMA_CONFIG[1:])
            if tokens == 1:  # projections of one token
                w, ws = _empty(1536, hidden, dtype=wdtype), _empty(12, hidden // 128, dtype=f32) if fp8 else None
                gemv(x, w, ws, block if fp8 else None)
                if fp8:  # the products on the tensor cores
                    gemv(x, w, ws, block, dot=True)
            lens = torch.full((min(tokens, 64),), 1024, dtype=i32)
            # V3's heads on one GPU, and over four ranks (32 a rank: another tile choice)
            for h, cache in itertools.product((heads, 32) if heads == 128 else (heads,),
                                              (_empty(64 * 16, page, lora + rope),
                                               _empty(64 * 16, page, fp8_row, dtype=torch.uint8))):
                mla_decode_attention(_empty(len(lens), h, lora), _empty(len(lens), h, rope), cache,
                                     torch.zeros(len(lens), 16, dtype=i32), lens, 0.1)
                if tokens == 64 and h <= 16:  # a verification's 4 query tokens a sequence, folded into the heads
                    mla_decode_attention(_empty(64, h, lora), _empty(64, h, rope), cache, torch.zeros(64, 16, dtype=i32),
                                         lens, 0.1, queries_per_seq=4)
            cu = torch.tensor([0, tokens], dtype=i32)
            mla_prefill_attention(q[..., :nope], q[..., nope:], _empty(tokens, heads, nope), _empty(tokens, rope),
                                  _empty(tokens, heads, vdim), cu, cu, tokens, 0.1)
        sample(_empty(8, vocab, dtype=f32), _empty(8, dtype=f32), torch.zeros(8, dtype=i64), torch.zeros(1, dtype=i64))
        sample(_empty(8, vocab, dtype=f32), _empty(8, dtype=f32), torch.zeros(8, dtype=i64), torch.zeros(1, dtype=i64),
               top_p=_empty(8, dtype=f32))
        greedy(_empty(4, vocab, dtype=f32), _empty(4, 3, dtype=i64)[:, 0])
    noise_keys(torch.zeros(8, dtype=i64), torch.zeros(8, dtype=i64))
    launch_spec_step()
    launch_v4_decode()
    launch_v4_weights()


def launch_v4_weights() -> None:
    """DeepSeek-V4 Flash's weights as it ships them: the MXFP4 routed experts (2 x 2048 x 4096 and 4096 x
    2048, top-6) as GEMVs at decode sizes and the grouped GEMM from decode to prefill sizes; the grouped
    wo_a (8 groups of 1024 x 4096) as one GEMV, FP8 and bf16."""
    from engine.kernels.fp8_gemm import FP8
    from engine.kernels.fused_moe import fused_experts
    from engine.kernels.gemv import gemv
    from engine.kernels.moe_gemv import moe_gemv
    from engine.kernels.mxfp4 import dequantize

    u8, f32 = torch.uint8, torch.float32
    hidden, inter, top_k = 4096, 2048, 6
    w13, s13 = _empty(16, 2 * inter, hidden // 2, dtype=u8), _empty(16, 2 * inter, hidden // 32, dtype=u8)
    w2, s2 = _empty(16, hidden, inter // 2, dtype=u8), _empty(16, hidden, inter // 32, dtype=u8)
    for tokens in (1, 8, 64, 4096):
        x, weights = _empty(tokens, hidden), _empty(tokens, top_k, dtype=f32)
        ids = (torch.arange(tokens * top_k, dtype=torch.int32) % 16).view(tokens, top_k)
        if tokens <= 8:  # every decode of the codes (the inline PTX's included)
            for decode in ("words", "asm"):
                moe_gemv(x, w13, w2, weights, ids, s13, s2, swiglu_limit=10.0, fp4_decode=decode)
        fused_experts(x, w13, w2, weights, ids, s13, s2, swiglu_limit=10.0)
        if tokens >= 64:  # the codes and scales through tl.dot_scaled (a benchmark variant)
            fused_experts(x, w13, w2, weights, ids, s13, s2, swiglu_limit=10.0, fp4_dot_scaled=True)
    dequantize(w13, s13, torch.bfloat16)  # prefill batches: every expert to bf16, then the bf16 grouped GEMM
    out = _empty(1, 8 * 4096)
    gemv(out, _empty(8 * 1024, 4096, dtype=FP8), _empty(64, 32, dtype=f32), (128, 128), groups=8)
    gemv(out, _empty(8 * 1024, 4096), groups=8)


def launch_spec_step() -> None:
    """A speculative step's bookkeeping: decode rows' slots (one row, a graph's 512), a fused step's
    acceptance and next rows for one sequence and sixteen of k = 3 drafts."""
    from engine.kernels.spec_step import accept, advance, decode_rows

    i32, i64 = torch.int32, torch.int64
    for rows in (1, 512):
        decode_rows(torch.zeros(rows, dtype=i64), torch.zeros(rows, 16, dtype=i32), 64)
    k = 3
    for seqs in (1, 16):
        n = seqs * (k + 1)
        tokens, counts = torch.zeros(n, dtype=i64), torch.zeros(seqs, dtype=i64)
        accept(tokens, tokens, k, counts)
        advance(tokens, counts, torch.zeros(seqs, k, dtype=i64), torch.zeros(n, 16, dtype=i32), 0, tokens, tokens,
                tokens, tokens)


def launch_v4_decode() -> None:
    """DeepSeek-V4 Flash's decode attention (64 heads of 512, window 128; CSA ratio 4 with top-512
    picks, HCA ratio 128; 256-token pages), its indexer (64 heads of 128), split and unsplit, its
    compressors' decode step, norms, rotations and the mix after a sublayer."""
    from engine.kernels.compressed_decode import dual_pool_decode, indexer_decode_scores
    from engine.kernels.compressor import compress_decode
    from engine.kernels.mhc import hc_mix
    from engine.kernels.norm_rope import norm_rope

    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    page, dim, heads = 256, 512, 64
    for batch in (1, 64):  # slices and a merge at one stream; one launch at 64
        q, sinks = _empty(batch, heads, dim), _empty(heads, dtype=f32)
        tables, pos = torch.zeros(batch, 16, dtype=i32), torch.full((batch,), 1023, dtype=i64)
        for ratio, picks in ((0, None), (4, torch.zeros(batch, 512, dtype=i64)), (128, None)):
            entries = _empty(64, page // ratio, dim) if ratio else None
            # the window through its own pages, as the model reads it
            dual_pool_decode(q, _empty(16, page, dim), entries, tables, pos, sinks, dim**-0.5, 128, ratio, picks,
                             window_pages=torch.zeros(64, dtype=i32))
        indexer_decode_scores(_empty(batch, heads, 128), _empty(batch, heads, dtype=f32), _empty(64, page // 4, 128),
                              tables, pos, 4, 1024, 128**-0.5)
        # the norms (hidden 4096, q LoRA 1024, the kv head 512) and the rotations (64 of 512 a head)
        for d in (4096, 1024, 512):
            norm_rope(_empty(batch, d), _empty(d, dtype=f32), 1e-6)
        norm_rope(q, positions=pos, cos=_empty(4096, 32, dtype=f32), sin=_empty(4096, 32, dtype=f32), inverse=True)
        hc_mix(_empty(batch, 4, 4096), _empty(batch, 4096), _empty(batch, 4, dtype=f32), _empty(batch, 4, 4, dtype=f32))
        # the compressors: CSA's (overlapping, d 512), its indexer's (d 128), HCA's (d 512)
        for d, ratio, overlap in ((512, 4, True), (128, 4, True), (512, 128, False)):
            width = 2 * d if overlap else d
            args = (_empty(batch, width), _empty(batch, width), _empty(ratio, width, dtype=f32), pos, tables,
                    _empty(64, 1, 8192, dtype=f32), 0, _empty(64, page // ratio, d), _empty(d, dtype=f32), 1e-6,
                    _empty(4096, 32, dtype=f32), _empty(4096, 32, dtype=f32), ratio, overlap)
            compress_decode(*args)
            # verifications of 3 drafts as decode rows, each row's state kept
            compress_decode(*args, torch.zeros(batch, dtype=i64), 4,
                            (_empty(batch, 3 * width, dtype=f32), torch.zeros(batch, dtype=i64)))


def compile_gluon() -> list[dict]:
    """The Gluon kernels, Hopper's only (warpgroup products, TMA, register moves between partitions), at
    the engine's constants: the warp-specialised prefill attention (`mla_prefill_gluon`), the FP8
    experts' GEMMs (`fused_moe_gluon`) and the decode attention's split kernels (`mla_decode_gluon`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from engine.kernels import fused_moe_gluon as m
    from engine.kernels import mla_prefill_gluon as g
    from engine.kernels._gluon import WG_ROWS, descriptor, signature_of

    kernel = g._ws_prefill_kernel
    rows = int(WG_ROWS)
    blocks = dict(qn_desc=[rows, g.NOPE], qp_desc=[rows, g.ROPE], kn_desc=[g.BLOCK_N, g.NOPE],
                  kp_desc=[g.BLOCK_N, g.ROPE], v_desc=[g.BLOCK_N, g.VDIM])
    sig = {name: signature_of(descriptor(_empty(256, 512), block)) for name, block in blocks.items()}
    sig.update(O="*bf16", CuQ="*i32", CuK="*i32", stride_ot="i32", stride_oh="i32", num_m_blocks="i32",
               scale_log2="fp32")
    # the head strides of the engine's views: q [T, H, 192], the expanded latents [T, H, 256]
    constexprs = dict(HEAD_QN=192, HEAD_QP=192, HEAD_KN=256, HEAD_V=256, BLOCK_N=g.BLOCK_N, STAGES=g.STAGES,
                      CONSUMER_REGS=g.CONSUMER_REGS, PRODUCER_REGS=g.PRODUCER_REGS)
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    builds = [(kernel, sig, constexprs)]
    # the FP8 experts' GEMMs (`fused_moe_gluon`): w13 gated, w2 weighted
    kernel, fp8 = m._ws_moe_gemm_kernel, torch.float8_e4m3fn
    for gated, block_n in ((True, m.BLOCK_N13), (False, m.BLOCK_N2)):
        sig = dict(a_desc=signature_of(descriptor(_empty(256, 512, dtype=fp8), [rows, 128])),
                   b_desc=signature_of(descriptor(_empty(256, 512, dtype=fp8), [block_n, 128])),
                   AS="*fp32", BS="*fp32", C="*bf16", Weights="*fp32", SortedIds="*i32", BlockExpert="*i32",
                   NumPadded="*i32", N="i32", K="i32", num_pairs="i32", top_k="i32", stride_asm="i32",
                   stride_ask="i32", stride_bse="i32", stride_bsn="i32", stride_cm="i32")
        constexprs = dict(GATED=gated, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, STAGES=m.STAGES, NUM_PROGRAMS=132,
                          CONSUMER_REGS=m.CONSUMER_REGS, PRODUCER_REGS=m.PRODUCER_REGS)
        sig.update(dict.fromkeys(constexprs, "constexpr"))
        builds.append((kernel, sig, constexprs))
    # the decode attention's split kernels (`mla_decode_gluon`): bf16 rows by TMA, FP8 rows decoded, at 16
    # heads a program (V2-Lite; V3 over eight GPUs) with and without slices, at 32 (V3 over four), over
    # pages of 64 tokens (a tile) and of 16 (the engine's default: four pages a tile)
    from engine.kernels import mla_decode_gluon as d
    from engine.kernels.mla_decode import L2_PREFETCH_TILES

    lora, rope = int(d.KV_LORA), int(d.ROPE)
    common = dict(QL="*bf16", QP="*bf16", Tables="*i32", Lens="*i32", MidO="*fp32", MidLse="*fp32", Out="*bf16",
                  **dict.fromkeys(["stride_qlb", "stride_qlh", "stride_qpb", "stride_qph", "stride_tb", "table_width",
                                   "num_pages", "stride_mb", "stride_mh", "stride_ms", "stride_ob", "stride_oh",
                                   "num_heads", "num_splits"], "i32"),
                  scale_log2="fp32")
    fp8 = dict(Cache="*fp8e4nv", CacheR="*bf16", CacheS="*fp32", **common,
               **dict.fromkeys(["stride_cb", "stride_ct", "stride_rb", "stride_rt", "stride_sb"], "i32"))
    # (heads a program, one slice, page, query tokens folded: two tokens of 16 heads, one verified draft)
    for heads, direct, page, qrows in ((16, False, 64, 1), (16, True, 64, 1), (32, False, 64, 1), (16, False, 16, 1),
                                       (32, False, 16, 2)):
        fold = dict(QROWS=qrows, ROW_HEADS=heads // qrows if qrows > 1 else 1)  # the launcher's defaults unfolded
        rows = min(page, int(d.BLOCK_N))
        tma = dict(ckv_desc=signature_of(descriptor(_empty(256, lora + rope), [rows, lora])),
                   kpe_desc=signature_of(descriptor(_empty(256, lora + rope), [rows, rope])), Rows="*bf16", **common)
        # in the decode chain: launched with programmatic dependent launch, as the engine does on Hopper, the
        # slice's first tiles asked of L2 before the wait (a piece's 128-byte lines: bf16 rows, c_kv, k_pe)
        l2 = dict(L2_TILES=L2_PREFETCH_TILES, LINES_C=d.prefetch_lines(page, 2 * (lora + rope)))
        constexprs = dict(H=heads, PAGE=page, STAGES=d.STAGES, DIRECT=direct, LOADER_REGS=d.TMA_REGS, PDL=True, **l2,
                          **fold)
        builds.append((d._tma_decode_kernel, dict(tma, **dict.fromkeys(constexprs, "constexpr")), constexprs))
        # the FP8 rows by one loader warpgroup or two (at 16 heads), staged as codes or decoded
        for codes, loaders in itertools.product((True, False), (1, 2) if heads == 16 else (1,)):
            constexprs = dict(H=heads, PAGE=page, STAGES=d.STAGES, DIRECT=direct,
                              LOADER_REGS=d.FP8_REGS[codes, loaders], PDL=True, LOADERS=loaders, CODES=codes,
                              L2_TILES=L2_PREFETCH_TILES, LINES_C=d.prefetch_lines(page, lora),
                              LINES_R=d.prefetch_lines(page, 2 * rope), **fold)
            builds.append((d._fp8_decode_kernel, dict(fp8, **dict.fromkeys(constexprs, "constexpr")), constexprs))
    results = []
    for kernel, sig, constexprs in builds:
        options = dict(num_warps=4, launch_pdl=True) if constexprs.get("PDL") else dict(num_warps=4)
        source = GluonASTSource(kernel, {n: sig[n] for n in kernel.arg_names}, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        results.append(dict(key=(kernel.__name__, str(constexprs)), kernel=kernel.__name__,
                            shared=compiled.metadata.shared, constexprs=constexprs, options=options,
                            waits="griddepcontrol.wait" in compiled.asm["ptx"], spills=_spills(compiled.asm["ptx"]),
                            late_l2=constexprs.get("L2_TILES", 0) > 0 and not _asks_l2_first(compiled.asm["ptx"])))
    return results


def _asks_l2_first(ptx: str) -> bool:
    """Whether a kernel asks L2 for its first tiles before it waits for the kernel ahead (the prefetch's point)."""
    first, wait = ptx.find("prefetch.global.L2"), ptx.find("griddepcontrol.wait")
    return 0 <= first < wait


def _spills(ptx: str, arch: int = 90) -> int:
    """Bytes a thread spills to local memory, by ptxas (Triton's own) on the kernel's PTX: the Gluon
    kernels set their partitions' registers by hand (`setmaxnreg`), and a budget too small spills."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", out))


def compile_all(arch: int = 90) -> list[dict]:
    """-> one entry per distinct kernel variant compiled: name, shared memory bytes, constexprs."""
    results: list[dict] = []
    with compiling_for(arch, results):
        launch_all()
    if arch == 90:
        results += compile_gluon()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability times ten (90: Hopper)")
    args = p.parse_args(argv)
    results = compile_all(args.arch)
    limit = SHARED_LIMIT.get(args.arch)
    bad = [r for r in results if limit is not None and r["shared"] > limit]
    unsafe = [r for r in results if r["options"].get("launch_pdl") and not r["waits"]]
    for r in results:
        flag = "  over the limit" if r in bad else ""
        flag += "  launched early but never waits" if r in unsafe else ""
        flag += f"  spills {r['spills']} bytes" if r.get("spills") else ""
        flag += "  asks L2 only after waiting" if r.get("late_l2") else ""
        print(f"{r['kernel']:22s} shared {r['shared']:7d} B  {r['options']}{flag}")
    print(f"{len(results)} kernel variants compiled for sm_{args.arch}")
    return 1 if bad or unsafe else 0


if __name__ == "__main__":
    sys.exit(main())
