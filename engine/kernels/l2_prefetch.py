"""Weights asked of L2 ahead of the kernel that reads them, while latency-bound kernels leave HBM idle.

At one decoding token a layer's attention block (latent write, split and merge, the absorptions) moves a
few megabytes in ~20 us: the HBM is idle most of that time. The GEMVs after it are bound by bytes, and
part of what they read does not depend on the token: o_proj's weight, and the MLP weights that every
token reads (a MoE layer's shared experts, a dense layer's MLP). Asked of L2 when the block starts, those
bytes come in during the idle time and their GEMVs read them from L2.

One `cp.async.bulk.prefetch.L2.global [addr], size` (sm_90) has the SM's TMA unit request `size` bytes
into L2, fire and forget: no register, no barrier, nothing waits for it. One TMA unit requests lines at a
bounded rate, so the chunks are spread over many small programs, one chunk a lane.

The ranges are taken in the order their readers run and cut at a byte budget: L2 holds 50 MB on an
H100 / H200, and what the block itself reads (the cache, W_UV) passes through it too.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, interpreted, pdl

CHUNK = 16384  # bytes one bulk prefetch asks for
CHUNKS = 32  # chunks a program of the launcher's own (one warp: one a lane; a tensor narrower than the
# program's threads would be repeated on several, each asking again)
MAX_RANGES = 3


@dataclass(frozen=True)
class L2Ranges:
    """Up to MAX_RANGES byte ranges [address, address + nbytes), in the order they will be read; each
    address 16-byte aligned and each size a multiple of 16 (the bulk prefetch's contract). `tensors`
    keeps the memory alive for as long as the ranges are used (a CUDA graph replays the addresses)."""

    tensors: tuple[torch.Tensor, ...]
    nbytes: tuple[int, ...]

    @classmethod
    def of(cls, tensors: list[torch.Tensor], budget: int) -> "L2Ranges | None":
        """The first `budget` bytes of the tensors' storage, in the order given (the last range cut short,
        tensors past the budget left out); None when nothing is left."""
        kept, sizes = [], []
        for t in tensors:
            check(t.is_contiguous(), "an L2 prefetch range must be a contiguous tensor")
            check(t.data_ptr() % 16 == 0, "an L2 prefetch range must start 16-byte aligned")
            if len(kept) == MAX_RANGES or budget < 16:
                break
            n = min(t.numel() * t.element_size(), budget) // 16 * 16
            if not n:
                continue
            kept.append(t)
            sizes.append(n)
            budget -= n
        return cls(tuple(kept), tuple(sizes)) if kept else None

    @property
    def total(self) -> int:
        return sum(self.nbytes)

    def chunks(self) -> tuple[int, ...]:
        """Chunks of each range (a chunk never crosses from one range into the next)."""
        return tuple(triton.cdiv(n, CHUNK) for n in self.nbytes)

    def programs(self, chunks: int = CHUNKS) -> int:
        """Programs of `chunks` chunks each (one a thread: 32 a warp) that ask for every chunk."""
        return triton.cdiv(sum(self.chunks()), chunks)

    def args(self) -> tuple:
        """(B0, n0, c0, B1, n1, c1, B2, n2, c2): unused ranges repeat the first tensor with no chunks."""
        padded = [(t, n, c) for t, n, c in zip(self.tensors, self.nbytes, self.chunks())]
        padded += [(self.tensors[0], 0, 0)] * (MAX_RANGES - len(padded))
        return tuple(x for triple in padded for x in triple)


SITES = ("write", "write-fused", "output")


def check_site(site: str) -> None:
    check(site in SITES, f"an L2 prefetch site is one of {', '.join(SITES)}, got {site!r}")


@dataclass(frozen=True)
class LayerPrefetch:
    """What a decoder layer asks of L2 at steps of up to max_tokens tokens, and where: "write" in a launch
    of its own after the latent write; "write-fused" from more programs of the write's launch where it
    absorbs one token's query (a launch of its own otherwise); "output" in a launch of its own before
    o_proj (the ranges then start at the MLP's)."""

    site: str
    ranges: L2Ranges
    max_tokens: int


@triton.jit
def _chunk_address(B0, n0, c0, B1, n1, c1, B2, n2, c, CHUNK: tl.constexpr):
    """Chunk indices c over the ranges' concatenation -> (its range, byte offset in it, bytes to ask for:
    0 past the last chunk)."""
    in1 = (c >= c0) & (c < c0 + c1)
    in2 = c >= c0 + c1
    local = tl.where(in2, c - c0 - c1, tl.where(in1, c - c0, c)).to(tl.int64) * CHUNK
    n = tl.where(in2, n2, tl.where(in1, n1, n0)).to(tl.int64)
    size = tl.maximum(tl.minimum(n - local, CHUNK), 0)
    r = tl.where(in2, 2, tl.where(in1, 1, 0))
    return r, local, size


@triton.jit
def issue_l2_prefetch(B0, n0, c0, B1, n1, c1, B2, n2, c2, Trace, pid, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                      TRACE: tl.constexpr):
    """Program pid's chunks (CHUNKS of them, one a lane) asked of L2. TRACE (the interpreter, which runs
    no PTX): each chunk's (address, bytes) stored to Trace [programs * CHUNKS, 2] instead."""
    c = pid * CHUNKS + tl.arange(0, CHUNKS)
    r, local, size = _chunk_address(B0, n0, c0, B1, n1, c1, B2, n2, c, CHUNK)
    base = tl.where(r == 2, B2.to(tl.pointer_type(tl.int8)) + local,
                    tl.where(r == 1, B1.to(tl.pointer_type(tl.int8)) + local, B0.to(tl.pointer_type(tl.int8)) + local))
    if TRACE:
        rows = Trace + c.to(tl.int64) * 2
        tl.store(rows, base.to(tl.int64))
        tl.store(rows + 1, size)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [base, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(B0, n0, c0, B1, n1, c1, B2, n2, c2, Trace, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                     TRACE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    # nothing here depends on the kernels ahead: ask first, then keep the stream's order. Only program 0
    # waits for the kernel ahead, which is enough for the kernel after this one: it waits for this whole
    # grid, and so for that kernel too; the other programs leave at once and free their SMs.
    issue_l2_prefetch(B0, n0, c0, B1, n1, c1, B2, n2, c2, Trace, pid, CHUNK, CHUNKS, TRACE)
    if PDL:
        if pid == 0:
            tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def prefetch_l2_(ranges: L2Ranges, trace: torch.Tensor | None = None) -> None:
    """Ask L2 for the ranges' bytes, in one launch (ordered in the stream like any kernel; under
    programmatic dependent launch it starts while the kernel ahead runs). trace: an int64 tensor
    [ranges.programs() * CHUNKS, 2] that gets each chunk's (address, bytes) instead (the interpreter
    has no PTX: the CPU tests check the chunks cover the ranges)."""
    first = ranges.tensors[0]
    check(trace is not None or not interpreted(first), "an L2 prefetch runs on a GPU (or traces its chunks)")
    on = pdl(first) and trace is None
    _prefetch_kernel[(ranges.programs(),)](*ranges.args(), first if trace is None else trace, CHUNK=CHUNK,
                                           CHUNKS=CHUNKS,
                                           TRACE=trace is not None, PDL=on, launch_pdl=on, num_warps=1)


def reference_chunks(ranges: L2Ranges) -> list[tuple[int, int]]:
    """What `prefetch_l2_` asks for, chunk by chunk: (address, bytes), each range whole, in order."""
    return [(t.data_ptr() + off, min(CHUNK, n - off)) for t, n in zip(ranges.tensors, ranges.nbytes)
            for off in range(0, n, CHUNK)]
