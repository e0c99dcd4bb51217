"""What the Gluon kernels (Hopper's warp-specialised ones) share: the TMA load, the partition barrier and
a shared buffer's reinterpretation under their names in the installed Triton, the form `warp_specialize`
takes there, the consumer warpgroups' rows, the wait of programmatic dependent launch, and host-side TMA
descriptors."""

import inspect

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Gluon's TMA load is `async_load` in newer Triton, `async_copy_global_to_shared` before (kept there as a
# deprecated alias that raises)
tma_load = tma.async_copy_global_to_shared
if hasattr(tma, "async_load"):
    tma_load = tma.async_load
# a barrier of the partition's warps: `thread_barrier` in Triton 3.6, `barrier` in newer ones
thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# newer Gluon: warp_specialize([(fn, args), ...], warps, regs); earlier: (default_args, default_fn,
# worker_args, worker_fns, warps, regs), the workers sharing one argument tuple
WS_LIST_FORM = gl.constexpr("functions_and_args" in inspect.signature(gl.warp_specialize).parameters)
# a shared buffer viewed as another dtype: `reinterpret` in newer Gluon, `_reinterpret` in Triton 3.6
REINTERPRET_NAMED = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
WG_ROWS = gl.constexpr(64)  # rows of one consumer warpgroup (wgmma's M); a block is 2 x 64

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


@gluon.jit
def wait_for_inputs(PDL: gl.constexpr):
    """`_util.wait_for_inputs` for Gluon kernels: under programmatic dependent launch, wait for the kernel
    ahead and its writes, then let the next one start launching; without PDL, nothing."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def reinterpret(mem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """The shared buffer `mem` viewed as `dtype` [shape] in `layout` (the same bytes)."""
    if REINTERPRET_NAMED:
        view = mem.reinterpret(dtype, shape, layout)
    else:
        view = mem._reinterpret(dtype, shape, layout)
    return view


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of the 2-D tensor t, `block` a tile, in the default swizzled shared layout."""
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def signature_of(desc) -> str:
    """A tensor descriptor's type in a kernel signature (Triton 3.9 asks the descriptor, 3.6 the runtime)."""
    if hasattr(desc, "__mangle__"):
        return desc.__mangle__()
    from triton.runtime.jit import mangle_type
    return mangle_type(desc)
