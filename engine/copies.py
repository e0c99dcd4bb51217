"""A step's small host <-> device copies, made so the host never waits for the device's queue.

While a step runs on the GPU the host is already preparing the next one (`LLMEngine` launches it before
it reads the tokens of the one running). A copy from pageable memory would undo that: CUDA stages it
through its own buffer and may wait for every kernel queued before it. Pinned memory copies
asynchronously, in queue order; torch's caching host allocator keeps a pinned buffer until the copies
queued on it are done, so fresh ones can be taken every step.
"""

import functools

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list as a tensor on `device`, without waiting for the kernels queued there."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@functools.lru_cache(maxsize=512)
def index_to_device(values: tuple, device: torch.device) -> torch.Tensor:
    """An int64 index (a tuple, nested for several rows) on `device`, kept there by value: a batch's
    slots and rows, and the gathers of a step launched ahead, repeat step after step while its requests
    run, so each is copied over once (a copy is a pinned buffer and a transfer: host time every step).
    Shared: read it, never write into it."""
    return to_device(values, torch.long, device)


class ToHost:
    """Device tensors copied to the host behind the work queued before them; `get()` waits for those
    copies only (not for anything queued later)."""

    def __init__(self, *tensors: torch.Tensor, within: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """within: (a contiguous device buffer, the sizes of its consecutive pieces) where the tensors are
        its first, third, fifth ... pieces (a fused speculative step's output, with padding between):
        copied whole, in one transfer, nothing gathered first."""
        self.ready = None
        if within is not None:  # (on a CPU too: the buffer is rewritten by its next step before it is read)
            span, sizes = within
            on_gpu = span.device.type == "cuda"
            buffer = torch.empty(span.shape, dtype=span.dtype, pin_memory=on_gpu)
            buffer.copy_(span, non_blocking=on_gpu)
            self.host = [piece.view(t.shape) for piece, t in zip(buffer.split(sizes)[::2], tensors)]
            if not on_gpu:
                return
        elif tensors[0].device.type != "cuda":
            self.host = [t.cpu() for t in tensors]
            return
        elif len(tensors) > 1 and all(t.dtype == tensors[0].dtype for t in tensors):
            # one buffer, one transfer (a speculative step's tokens, accepted counts and drafts)
            flat = torch.cat([t.reshape(-1) for t in tensors])
            buffer = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            buffer.copy_(flat, non_blocking=True)
            self.host, start = [], 0
            for t in tensors:
                self.host.append(buffer[start : start + t.numel()].view(t.shape))
                start += t.numel()
        else:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self.host, tensors):
                host.copy_(t, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def get(self) -> list[torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host
