"""Tensor and expert parallelism: which slice of the model a rank holds, and the collectives between ranks.

One `ParallelContext` per rank, passed to every layer that shards (no module globals). With
`enable_expert_parallel` the routed experts are partitioned across the tensor-parallel ranks (each
rank holds E / tp whole experts) instead of each expert's intermediate width being split; attention,
dense MLPs and shared experts stay tensor-parallel either way, so every rank sees every token and an
MoE layer ends in one all-reduce of the routed and shared partial sums (the combine of the
all-gather + reduce-scatter scheme, which suits small decode batches: no token leaves its rank).
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    enable_expert_parallel: bool = False
    group: Any = field(default=None, compare=False, repr=False)  # the ranks' ProcessGroup (None: one rank)

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.enable_expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.enable_expert_parallel else 0

    @property
    def expert_tp_size(self) -> int:
        """How many ranks split each routed expert's intermediate width (1 under expert parallelism)."""
        return 1 if self.enable_expert_parallel else self.tp_size

    @property
    def expert_tp_rank(self) -> int:
        return 0 if self.enable_expert_parallel else self.tp_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (in place); x itself on one rank."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., tp * n], rank by rank along the last dimension."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelContext()


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}")
    return n // d
