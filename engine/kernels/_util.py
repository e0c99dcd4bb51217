"""Small helpers shared by the launchers."""

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pow2(n: int, minimum: int = 16) -> int:
    """Block width covering n (tl.dot wants every dimension >= 16)."""
    return max(minimum, triton.next_power_of_2(n))


def check(cond: bool, message: str) -> None:
    """A launcher's contract: raise ValueError (not assert, which -O strips) naming what is wrong."""
    if not cond:
        raise ValueError(message)


def check_float(name: str, t: torch.Tensor) -> None:
    check(t.dtype in FLOAT_DTYPES, f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_last_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.stride(-1) == 1, f"{name} must be contiguous in its last dimension (strides {tuple(t.stride())})")


@functools.cache
def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may take on this GPU (0 off a GPU)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """tl.dot, with operands widened to float32 under the interpreter (whose bf16 dot is wrong). Float32
    operands multiply in full float32, not TF32: float32 is the precision the tests compare paths in,
    never a serving dtype, so exactness is worth more there than speed."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel
# before it in the stream is still running, and waits (`wait_for_inputs`) only where it first needs that
# kernel's output. At decode, where a layer is a chain of a dozen kernels of a few microseconds each, the
# next kernel's launch, setup and constant loads (a GEMV's first weight tiles) overlap the previous
# kernel's tail instead of following it. False turns it off for every launcher (`bench --no-pdl`).
PDL = True


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def pdl(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with programmatic dependent launch (`PDL` and sm_90+)."""
    return PDL and t.is_cuda and _capability(t.device) >= 9


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the previous kernel in the stream has finished and
    its writes are visible, then let the next kernel start launching. Every kernel launched with PDL calls
    this before it reads the previous kernel's output or writes anything. Because each does so before
    releasing its successor, a kernel may read, before waiting, memory written two or more launches back
    (constant weights, a routing result the previous kernel itself waited for). Without PDL, nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def last_program(Counter, programs):
    """Whether this program is the last of `programs` to get here, each having stored its part of a
    result before: then every part is visible to it, and it may finish the result in the same launch
    (a norm, a top-k) instead of a kernel after. Counter: an int32 zero, left zero again for the next
    launch (a CUDA graph replays the same one). The barrier orders every thread's stores before the
    release; the atomic's acquire makes the other programs' stores visible (load them past L1)."""
    tl.debug_barrier()
    done = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu")
    last = done == programs - 1
    if last:
        tl.store(Counter, 0)
    return last


# one `prefetch.global.L2` of the line at $1 where $2 is non-zero ($0 a dummy result): `prefetch_l2`'s, and
# the Gluon decode kernel's (`mla_decode_gluon._prefetch_l2`, whose ranges need a layout)
PREFETCH_L2_ASM = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")


@triton.jit
def prefetch_l2(Base, nbytes, LINES: tl.constexpr):
    """Ask L2 for the first nbytes (at most LINES * 128) at Base: one `prefetch.global.L2` a 128-byte line,
    fire and forget (no register holds the data, nothing waits for it). Before `wait_for_inputs` it starts
    a kernel's reads of what was written two or more launches back (an old cache row) while the kernel
    ahead finishes; L2 is where the GPU's memory is coherent, so a line the kernel ahead rewrites is never
    stale. GPU only (inline PTX)."""
    offs = tl.arange(0, LINES) * 128
    tl.inline_asm_elementwise(PREFETCH_L2_ASM, "=r,l,r", [Base.to(tl.pointer_type(tl.int8)) + offs,
                                                         (offs < nbytes).to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def gluon_available() -> bool:
    """Whether the installed Triton has Gluon with Hopper's TMA and warp specialization (3.5 on), which the
    Gluon kernels are written in; without it the Triton kernels serve."""
    try:
        from engine.kernels import fused_moe_gluon, mla_decode_gluon, mla_prefill_gluon  # noqa: F401
    except (ImportError, AttributeError):  # no Gluon, or one without what the kernels use
        return False
    return True


def interpreted(t: torch.Tensor) -> bool:
    """Kernels on CPU tensors run in Triton's interpreter."""
    return not t.is_cuda


def upcast_fp8_dot(t: torch.Tensor, block_k: int) -> bool:
    """FP8 tensor-core products need K tiles of 32 or more; smaller blocks (test checkpoints) multiply in
    float32, which holds every e4m3 value and product exactly."""
    return interpreted(t) or block_k < 32


def on_compile(callback: Callable[[str], None] | None) -> None:
    """Call callback(kernel variant) each time a Triton kernel variant is about to be built in this
    process (a miss of its in-memory cache: compiled, or loaded from the disk cache); None stops.
    Serving uses it to name kernels met only after warm-up, whose first use stalls a whole step."""
    def hook(*args, **kwargs) -> None:
        # the specialization (argument types, constants, divisibility facts) tells which argument made
        # a new variant; returning a true value would skip the build
        spec = (kwargs.get("compile") or {}).get("specialization_data")
        callback(str(spec or kwargs.get("repr") or kwargs.get("key", "?")))

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        knobs.runtime.jit_cache_hook = hook if callback else None
    else:  # before Triton 3.4
        triton.runtime.jit.JITFunction.cache_hook = hook if callback else None
