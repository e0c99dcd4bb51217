"""MLA prefill attention in Gluon, FlashAttention-3's schedule, beside the engine's Triton kernel.

Triton's `tl.dot` waits on each product at its result's first use, so the softmax of a tile cannot run
while the tensor cores work on another product. Gluon issues `warpgroup_mma` asynchronously and waits
where told. `ws_prefill` (`engine.kernels.mla_prefill_gluon`, `mla_prefill_attention`'s contract: varlen,
a cached prefix; bf16; DeepSeek's head widths: nope 128, rope 64, v 128) is FlashAttention-3's whole
schedule, a producer warp feeding two consumer warpgroups. Timed here in two tile schedules; 64-key tiles
in three stages ran 1.14-1.25x the Triton kernel on an H200 and is the engine's choice where
`mla_prefill.GLUON` is on. (Two schedules measured slower there and since removed: the intra-warpgroup
overlap alone in eight warps, and the consumers' issues alternating, ping-pong; their rows are in
`benchmarks/results/mla_prefill_gluon.json`.)

    python benchmarks/mla_prefill_gluon.py [--out FILE] [--only TEXT]  # Hopper: check against the float32
                                                                        # reference, time beside the Triton kernel
    python benchmarks/mla_prefill_gluon.py --compile [--ptx DIR]       # no GPU: compile for sm_90
"""

import json
import sys

import torch
import triton

from engine.kernels._gluon import descriptor, signature_of
from engine.kernels.mla_prefill_gluon import _ws_prefill_kernel, ws_prefill


def _case(q_len, k_len, heads, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(q_len, heads, 192, generator=g, device=device).to(torch.bfloat16)
    kv = torch.randn(k_len, heads, 256, generator=g, device=device).to(torch.bfloat16)
    k_pe = torch.randn(k_len, 64, generator=g, device=device).to(torch.bfloat16)
    return q[..., :128], q[..., 128:], kv[..., :128], k_pe, kv[..., 128:]


def compile_only():
    """sm_90 compile through GluonASTSource (no GPU needed): shared memory, op counts, and the PTX for ptxas."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def compile_kernel(kernel, q_rows, block_n, constexprs, num_warps):
        sig = {}
        names = ["qn_desc", "qp_desc", "kn_desc", "kp_desc", "v_desc"]
        blocks = [[q_rows, 128], [q_rows, 64], [block_n, 128], [block_n, 64], [block_n, 128]]
        for name, block in zip(names, blocks):
            sig[name] = signature_of(descriptor(torch.empty(256, 512, dtype=torch.bfloat16), block))
        sig.update(O="*bf16", CuQ="*i32", CuK="*i32", stride_ot="i32", stride_oh="i32", num_m_blocks="i32",
                   scale_log2="fp32")
        constexprs = dict(HEAD_QN=192, HEAD_QP=192, HEAD_KN=256, HEAD_V=256, BLOCK_N=block_n, **constexprs)
        for c in constexprs:
            sig[c] = "constexpr"
        sig = {name: sig[name] for name in kernel.arg_names}  # in the signature's order
        src = GluonASTSource(kernel, sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))

    builds = [(f"ws s{stages} n{block_n}", _ws_prefill_kernel, 64, block_n,
               dict(STAGES=stages, CONSUMER_REGS=240, PRODUCER_REGS=24), 4) for block_n, stages in [(128, 2), (64, 3)]]
    for name, kernel, q_rows, block_n, constexprs, num_warps in builds:
        report_compiled(name, compile_kernel(kernel, q_rows, block_n, constexprs, num_warps))


def report_compiled(name, compiled):
    """One line of what an sm_90 build holds (shared memory, async products and their waits, TMA copies,
    register moves between partitions); with --ptx DIR its PTX written there, for ptxas -v."""
    ptx = compiled.asm["ptx"]
    print(f"{name}: shared {compiled.metadata.shared} bytes; wgmma {ptx.count('wgmma.mma_async')}, wait_group "
          f"{ptx.count('wgmma.wait_group')}, tma {ptx.count('cp.async.bulk.tensor')}, setmaxnreg "
          f"{ptx.count('setmaxnreg')}", flush=True)
    if "--ptx" in sys.argv:
        with open(f"{sys.argv[sys.argv.index('--ptx') + 1]}/{name.replace(' ', '_')}.ptx", "w") as f:
            f.write(ptx)


VARIANTS = {  # name -> ws_prefill's keyword arguments
    "warp-specialised, 2 stages, 128-key tiles": dict(stages=2, block_n=128),
    "warp-specialised, 3 stages, 64-key tiles": dict(stages=3, block_n=64),
}


def _run(name, *args):
    return ws_prefill(*args, **VARIANTS[name])


def main():
    if "--compile" in sys.argv:
        compile_only()
        return
    sys.path.insert(0, ".")
    from engine.bench.timing import time_replayed
    from engine.kernels.mla_prefill import mla_prefill_attention, reference_mla_prefill_attention

    scale = 192 ** -0.5
    dev = torch.device("cuda")
    # three sequences, the second a chunk after a cached prefix, the third shorter than a block
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1350, 16, 192, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(3398, 16, 256, generator=g, device="cuda").to(torch.bfloat16)
    k_pe = torch.randn(3398, 64, generator=g, device="cuda").to(torch.bfloat16)
    cq = torch.tensor([0, 1000, 1300, 1350], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 1000, 3348, 3398], dtype=torch.int32, device="cuda")
    args = (q[..., :128], q[..., 128:], kv[..., :128], k_pe, kv[..., 128:], cq, ck)
    ref = reference_mla_prefill_attention(*args, scale).float()
    working = []
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
    for name in [n for n in VARIANTS if only in n]:
        try:
            err = ((_run(name, *args, 1000, scale).float() - ref).norm() / ref.norm()).item()
            torch.cuda.synchronize()
        except Exception as e:  # a variant the installed Triton cannot build: report it, time the rest
            print(f"varlen check, {name}: failed: {str(e)[:400]}", flush=True)
            continue
        print(f"varlen check, {name}: rel err {err:.1e}", flush=True)
        if err < 1e-2:
            working.append(name)

    rows = []
    cu = lambda n: torch.tensor([0, n], dtype=torch.int32, device="cuda")
    for q_len, k_len, heads in [(8192, 8192, 16), (8192, 8192, 128), (4096, 32768, 16), (32768, 32768, 16)]:
        args = _case(q_len, k_len, heads, "cuda")
        cq, ck = cu(q_len), cu(k_len)
        ours = mla_prefill_attention(*args, cq, ck, q_len, scale, tiles={})  # tiles given: the Triton kernel
        pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2
        flops = heads * pairs * (2 * 192 + 2 * 128)
        t = time_replayed(lambda: mla_prefill_attention(*args, cq, ck, q_len, scale, tiles={}), dev, calls=5, repeats=5)
        rows.append(dict(variant="triton (engine)", heads=heads, q_len=q_len, k_len=k_len, tflops=flops / t / 1e12))
        line = f"H={heads} {q_len}@{k_len}: triton {rows[-1]['tflops']:.0f}"
        for name in working:
            fn = lambda: _run(name, *args, cq, ck, q_len, scale)
            err = ((fn().float() - ours.float()).norm() / ours.float().norm()).item()
            t = time_replayed(fn, dev, calls=5, repeats=5)
            rows.append(dict(variant=name, heads=heads, q_len=q_len, k_len=k_len, tflops=flops / t / 1e12,
                             rel_err_to_triton=err))
            line += f" | {name} {rows[-1]['tflops']:.0f} ({err:.0e})"
        print(line + " TFLOP/s", flush=True)
    if "--out" in sys.argv:
        out = sys.argv[sys.argv.index("--out") + 1]
        with open(out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
    if len(working) < len([n for n in VARIANTS if only in n]):
        sys.exit("a variant failed or differs from the reference")


if __name__ == "__main__":
    main()
