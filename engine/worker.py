"""One rank of a replica: its ModelRunner (the model's slice, KV pool, block tables, CUDA graphs) and
what a plan asks of a rank before the model runs: table deltas, blocks to copy from rank 0, and the
step's tokens when they are rank 0's draws still on its device.

Ranks other than 0 run `run_worker` in a process of their own: receive a plan (a broadcast from rank
0 over a gloo group), execute it, repeat; the model's collectives keep the ranks in step.
"""

import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner, resolve_device
from engine.parallel import ParallelContext
from engine.step_plan import DraftPlan, StepPlan, StepResult

logger = logging.getLogger(__name__)

# plans come whenever requests do: the control group must not time out while a replica idles
CONTROL_TIMEOUT = timedelta(days=365)


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path | None, max_model_len: int,
                 par: ParallelContext, device: torch.device, control_group=None):
        self.par, self.control_group = par, control_group
        self.runner = ModelRunner(config, model_config, path, max_model_len, par, device)

    def init_cache(self) -> int:
        """Size and allocate the KV pool: the fewest blocks any rank can hold, so all hold the same."""
        num_blocks = self.runner.num_blocks_that_fit()
        if self.par.tp_size > 1:
            fewest = torch.tensor([num_blocks], dtype=torch.long)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=self.control_group)
            num_blocks = int(fewest)
        self.runner.init_cache(num_blocks, self.runner.window_pages_for(num_blocks))
        return num_blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan, inputs: torch.Tensor | None = None,
                offsets: torch.Tensor | None = None) -> StepResult:
        """inputs: on rank 0, the step's tokens on the device where the plan carries none; offsets: on
        rank 0, the positions' offsets of a shifted plan."""
        runner = self.runner
        runner.tables.apply(plan.table_deltas)
        runner.kv_pool.map_window(plan.window_pages)
        if self.par.tp_size > 1:
            if plan.replicate_blocks:
                self._replicate(plan.replicate_blocks)
            if plan.input_ids is None:  # rank 0's draws: sent inside the step, never assumed equal
                if self.par.tp_rank != 0:
                    inputs = torch.empty(plan.num_tokens, dtype=torch.long, device=runner.device)
                inputs = inputs.contiguous()
                dist.broadcast(inputs, src=0, group=self.par.group)
            if plan.shifted:
                if self.par.tp_rank != 0:
                    offsets = torch.empty(plan.num_tokens, dtype=torch.long, device=runner.device)
                offsets = offsets.contiguous()
                dist.broadcast(offsets, src=0, group=self.par.group)
        return runner.run(plan, inputs, offsets)

    @torch.inference_mode()
    def propose(self, draft: DraftPlan, next_ids: torch.Tensor | None = None,
                accepted: torch.Tensor | None = None, verified: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MTP draft after the last step; next_ids [T], accepted [S] and verified [V] are rank 0's, on its
        device (the other ranks receive them: the draft runs the same collectives on every rank; verified
        only where the model rolls state back by it)."""
        runner = self.runner
        if self.par.tp_size > 1:
            if self.par.tp_rank != 0:
                plan = runner.last_step[0]
                next_ids = torch.empty(plan.num_tokens, dtype=torch.long, device=runner.device)
                accepted = torch.empty(len(draft.rows), dtype=torch.long, device=runner.device)
                verified = torch.empty(len(draft.verifications), dtype=torch.long, device=runner.device)
            next_ids = next_ids.contiguous()
            dist.broadcast(next_ids, src=0, group=self.par.group)
            if draft.rows:
                accepted = accepted.contiguous()
                dist.broadcast(accepted, src=0, group=self.par.group)
            if draft.verifications:
                verified = verified.contiguous()
                dist.broadcast(verified, src=0, group=self.par.group)
        return runner.propose(draft, next_ids, accepted, verified)

    def _replicate(self, block_ids: list[int]) -> None:
        """Rank 0's rows of these blocks (pulled from a peer) into every rank's pool: MLA's latent cache is
        held whole by every rank."""
        pool = self.runner.kv_pool
        index = torch.tensor(block_ids, dtype=torch.long, device=self.runner.device)
        pages = pool.window_page[index].long()  # the plan's window deltas are applied: every rank maps alike
        for i, cache in enumerate(pool.caches):
            rows = cache.index_select(0, pages if pool.is_window(i) else index)
            dist.broadcast(rows, src=0, group=self.par.group)
            if self.par.tp_rank != 0:
                cache.index_copy_(0, pages if pool.is_window(i) else index, rows)


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    device = resolve_device(config.device)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"{config.ranks_per_node} ranks per node need as many GPUs; this node has "
                             f"{torch.cuda.device_count()} (tensor_parallel_size {config.tensor_parallel_size}, "
                             f"nnodes {config.nnodes})")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def init_process_groups(config: EngineConfig, rank: int, init_method: str, device: torch.device):
    """-> (ParallelContext, the gloo group plans travel on). The model's collectives use NCCL on GPUs
    and gloo on CPUs, so every parallel path also runs without a GPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=config.tensor_parallel_size)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    par = ParallelContext(rank, config.tensor_parallel_size, config.enable_expert_parallel, group=dist.group.WORLD)
    return par, control


def run_worker(rank: int, config: EngineConfig, model_config: ModelConfig, path: Path | None, max_model_len: int,
               init_method: str, environ: dict[str, str] | None = None) -> None:
    """Entry point of a rank > 0: build its slice, then execute rank 0's plans until told to stop. environ:
    the starting process's environment (a fork server's may be older)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # ranks on one CPU share its cores
    _exit_with_parent()
    device = rank_device(config, rank % config.ranks_per_node)
    par, control = init_process_groups(config, rank, init_method, device)
    worker = Worker(config, model_config, path, max_model_len, par, device, control)
    worker.init_cache()
    box: list = [None]
    while True:
        dist.broadcast_object_list(box, src=0, group=control)
        plan = box[0]
        if plan is None:
            break
        if isinstance(plan, DraftPlan):
            worker.propose(plan)
        else:
            worker.execute(plan)
    dist.destroy_process_group()


def _exit_with_parent() -> None:
    """A rank whose parent (rank 0's process, or its node's launcher) is gone has nobody to serve."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
