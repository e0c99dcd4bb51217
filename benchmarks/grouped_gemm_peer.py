"""Our grouped expert GEMMs against PyTorch's CUTLASS grouped GEMM (`torch._grouped_mm`, what HF
transformers runs for DeepSeek's experts) at prefill sizes, bf16, on the GPU at hand.

    python benchmarks/grouped_gemm_peer.py [--tokens 2048,8192] [--preset v2-lite]

Both compute the whole MoE expert block (gate_up, SwiGLU, down, the weighted sum over the top-k) for
the same routed tokens; the peer's block is the sort, gathers and scatter around two `_grouped_mm`
calls. Each is timed with CUDA events around 20 calls after 3 to warm up
(no graphs: prefill steps run eager), and checked against the other.
"""

import argparse

import torch
import torch.nn.functional as F

from engine.kernels.fused_moe import fused_experts

SHAPES = {"v2-lite": (2048, 1408, 64, 6), "v3": (7168, 2048, 256, 8)}  # hidden, inter, experts, top_k


def grouped_mm_experts(x, w13, w2, weights, ids):
    """The block through torch._grouped_mm: pairs sorted by expert, no padding."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    offs = torch.bincount(flat, minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x[order // top_k], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    down = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    out = torch.empty_like(down)
    out[order] = down * weights.flatten()[order, None].to(down.dtype)
    return out.view(num_tokens, top_k, -1).sum(1)


def timed(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--preset", default="v2-lite", choices=sorted(SHAPES))
    args = p.parse_args()
    hidden, inter, experts, top_k = SHAPES[args.preset]
    dev = torch.device("cuda")
    g = torch.Generator(dev).manual_seed(0)
    w13 = (0.02 * torch.randn(experts, 2 * inter, hidden, device=dev, generator=g)).bfloat16()
    w2 = (0.02 * torch.randn(experts, hidden, inter, device=dev, generator=g)).bfloat16()
    print(f"{torch.cuda.get_device_name()}; {args.preset} experts ({experts} x top-{top_k}, hidden {hidden}, "
          f"inter {inter}), bf16")
    print(f"{'tokens':>7s} {'ours ms':>8s} {'TFLOP/s':>8s} {'_grouped_mm ms':>15s} {'TFLOP/s':>8s} {'rel diff':>9s}")
    for t in (int(s) for s in args.tokens.split(",")):
        x = torch.randn(t, hidden, device=dev, generator=g).bfloat16()
        ids = torch.rand(t, experts, device=dev, generator=g).argsort(-1)[:, :top_k].int().contiguous()
        weights = torch.rand(t, top_k, device=dev, generator=g).contiguous()
        ours, peer = fused_experts(x, w13, w2, weights, ids), grouped_mm_experts(x, w13, w2, weights, ids)
        diff = ((ours.float() - peer.float()).norm() / peer.float().norm()).item()
        flops = 2 * t * top_k * 3 * inter * hidden
        t_ours = timed(lambda: fused_experts(x, w13, w2, weights, ids))
        t_peer = timed(lambda: grouped_mm_experts(x, w13, w2, weights, ids))
        print(f"{t:7d} {t_ours * 1e3:8.2f} {flops / t_ours / 1e12:8.0f} {t_peer * 1e3:15.2f} "
              f"{flops / t_peer / 1e12:8.0f} {diff:9.2e}", flush=True)


if __name__ == "__main__":
    main()
