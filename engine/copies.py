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


class HostSpan:
    """A contiguous device buffer whose first, third, fifth ... pieces are tensors to copy to the host
    (a fused speculative step's output, padding between), with a host buffer (pinned on a GPU) of its size
    to copy it into, taken again step after step: fresh ones cost a pinned allocation, a split and a view
    per piece every step. A copy into it waits until the copy before has been read (`ToHost.lists`);
    the engine reads each step before it launches the one after next, so two spans taken in turn never
    wait, and a span whose last copy is still unread gives way to a fresh buffer."""

    def __init__(self, device: torch.Tensor, sizes: list[int], shapes: list[tuple[int, ...]]):
        self.device, self.sizes, self.shapes = device, sizes, shapes
        self.on_gpu = device.device.type == "cuda"
        with torch.inference_mode(False):  # written by copies made outside inference mode
            self.host = torch.empty(device.shape, dtype=device.dtype, pin_memory=self.on_gpu)
        self.reader: "ToHost | None" = None  # the copy that last used `host`


class ToHost:
    """Device tensors copied to the host behind the work queued before them; `get()` waits for those
    copies only (not for anything queued later)."""

    def __init__(self, *tensors: torch.Tensor, within: HostSpan | None = None) -> None:
        """within: a span holding the tensors as its kept pieces (`HostSpan`): copied whole, in one
        transfer, nothing gathered first."""
        self.ready = None
        self.span = within
        self._lists = None
        if within is not None:  # (on a CPU too: the buffer is rewritten by its next step before it is read)
            on_gpu = within.on_gpu
            if within.reader is not None and within.reader._lists is None:  # still unread: a buffer of its own,
                # the span's from now on (the unread one stays with its reader)
                with torch.inference_mode(False):
                    within.host = torch.empty(within.device.shape, dtype=within.device.dtype, pin_memory=on_gpu)
            self.buffer = within.host
            within.reader = self
            self.buffer.copy_(within.device, non_blocking=on_gpu)
            self.host = None  # views made only where `get()` asks for them
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
        if self.host is None:
            span = self.span
            self.host = [piece.view(shape) for piece, shape in zip(self.buffer.split(span.sizes)[::2], span.shapes)]
        return self.host

    def lists(self) -> list[list]:
        """The tensors as lists (each of its shape), waiting as `get()` does: a span's in one `tolist`."""
        if self._lists is None:
            if self.span is None:
                self._lists = [t.tolist() for t in self.get()]
            else:
                if self.ready is not None:
                    self.ready.synchronize()
                flat, start, self._lists = self.buffer.tolist(), 0, []
                for i, size in enumerate(self.span.sizes):
                    if i % 2 == 0:  # a kept piece (odd ones: padding)
                        piece, shape = flat[start : start + size], self.span.shapes[i // 2]
                        self._lists.append(piece if len(shape) == 1 else
                                           [piece[j : j + shape[1]] for j in range(0, size, shape[1])])
                    start += size
        return self._lists
