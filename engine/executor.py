"""Runs plans on the replica's ranks: in this process for one rank; one process per rank otherwise.

Rank 0's worker always lives in the engine's process (its logits feed the sampler there). With
several ranks, `MultiprocExecutor` starts this node's other ranks as processes, and each plan is
broadcast to every rank before rank 0 runs it; rank 0 decides graph-or-eager and the plan carries it.
On other nodes of a multi-node replica, `run_node` starts that node's ranks and waits on them.

A rank that dies ends the replica: its collectives would otherwise wait forever on the dead rank, and
a replica missing a slice of the model cannot answer. The engine process exits non-zero within a
second, so the server's `/ready` fails and the pod restarts.
"""

import logging
import multiprocessing
import os
import socket
import threading
import weakref
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import SINGLE
from engine.step_plan import DraftPlan, StepPlan, StepResult
from engine.worker import Worker, init_process_groups, rank_device, run_worker

logger = logging.getLogger(__name__)


class InProcessExecutor:
    """One rank, in this process."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path | None, max_model_len: int):
        self.driver = Worker(config, model_config, path, max_model_len, SINGLE, rank_device(config, 0))
        self.num_blocks = self.driver.init_cache()

    @property
    def runner(self) -> ModelRunner:
        return self.driver.runner

    def execute(self, plan: StepPlan, inputs: torch.Tensor | None = None,
                offsets: torch.Tensor | None = None) -> StepResult:
        plan.use_graph = self.runner.takes_graph(plan)
        return self.driver.execute(plan, inputs, offsets)

    def propose(self, draft: DraftPlan, next_ids: torch.Tensor, accepted: torch.Tensor | None,
                verified: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MTP draft after the step just executed -> [S, num_drafts] on rank 0's device, or None."""
        return self.driver.propose(draft, next_ids, accepted, verified)

    def shutdown(self) -> None:
        pass


class MultiprocExecutor(InProcessExecutor):
    """tensor_parallel_size ranks: rank 0 here, this node's others in processes of their own."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, path: Path | None, max_model_len: int):
        if config.node_rank != 0:
            raise ValueError("rank 0 (the engine) runs on node 0; other nodes run `run_node`")
        init_method = f"tcp://{config.dist_init_addr or _free_local_address()}"
        self.procs = _start_ranks(config, model_config, path, max_model_len, init_method,
                                  range(1, config.ranks_per_node))
        self._state = {"stopped": False}
        if self.procs:  # a node's own ranks; those of other nodes fail the next collective when they go
            threading.Thread(target=_watch_ranks, args=(self.procs, self._state), name="rank-watch",
                             daemon=True).start()
        try:
            device = rank_device(config, 0)
            par, self.control = init_process_groups(config, 0, init_method, device)
            self.driver = Worker(config, model_config, path, max_model_len, par, device, self.control)
            self.num_blocks = self.driver.init_cache()
        except BaseException:
            # rank 0 failed to start (out of memory, a bad checkpoint): the other ranks may wait in a
            # collective that will never come, so they are ended, not told
            self._state["stopped"] = True
            for proc in self.procs:
                proc.kill()
            raise
        # the ranks wait for plans: told to stop when this executor goes, or this process ends
        self._finalizer = weakref.finalize(self, _stop_ranks, self.control, self.procs, self._state)
        logger.info("%d ranks ready (tensor parallel%s, %d node(s))", config.tensor_parallel_size,
                    " + expert parallel" if config.enable_expert_parallel else "", config.nnodes)

    def execute(self, plan: StepPlan, inputs: torch.Tensor | None = None,
                offsets: torch.Tensor | None = None) -> StepResult:
        plan.use_graph = self.runner.takes_graph(plan)
        dist.broadcast_object_list([plan], src=0, group=self.control)
        return self.driver.execute(plan, inputs, offsets)

    def propose(self, draft: DraftPlan, next_ids: torch.Tensor, accepted: torch.Tensor | None,
                verified: torch.Tensor | None = None) -> torch.Tensor | None:
        dist.broadcast_object_list([draft], src=0, group=self.control)
        return self.driver.propose(draft, next_ids, accepted, verified)

    def shutdown(self) -> None:
        self._finalizer()


def _stop_ranks(control, procs: list, state: dict) -> None:
    state["stopped"] = True

    def tell() -> None:
        try:
            dist.broadcast_object_list([None], src=0, group=control)
        except RuntimeError:
            pass  # a rank is already gone

    # a rank stuck in a collective (a step that failed part-way) never takes the message: bounded
    telling = threading.Thread(target=tell, daemon=True)
    telling.start()
    telling.join(10)
    for proc in procs:
        proc.join(10 if not telling.is_alive() else 0)
        if proc.is_alive():
            proc.kill()
    if not telling.is_alive():
        dist.destroy_process_group()


def _watch_ranks(procs: list, state: dict) -> None:
    ready = wait([p.sentinel for p in procs])
    if state["stopped"]:
        return
    dead = next(p for p in procs if p.sentinel in ready)
    dead.join(1)  # its exit code
    logger.critical("rank %s exited (code %s): the replica cannot go on without it; exiting", dead.name,
                    dead.exitcode)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    os._exit(1)


def run_node(config: EngineConfig, model_config: ModelConfig, path: Path | None, max_model_len: int) -> int:
    """A node other than 0 of a multi-node replica: its ranks, until one of them exits -> exit code."""
    per_node = config.ranks_per_node
    first = config.node_rank * per_node
    procs = _start_ranks(config, model_config, path, max_model_len, f"tcp://{config.dist_init_addr}",
                         range(first, first + per_node))
    wait([p.sentinel for p in procs])
    failed = [p for p in procs if p.exitcode not in (None, 0)]
    for proc in procs:
        proc.join(10 if not failed else 0)
        if proc.is_alive():
            proc.kill()
    for proc in failed:
        logger.error("rank %s exited (code %s)", proc.name, proc.exitcode)
    return 1 if failed else 0


def create_executor(config: EngineConfig, model_config: ModelConfig, path: Path | None, max_model_len: int):
    cls = MultiprocExecutor if config.tensor_parallel_size > 1 else InProcessExecutor
    return cls(config, model_config, path, max_model_len)


def _start_ranks(config, model_config, path, max_model_len, init_method, ranks) -> list:
    # Never fork a process that may hold CUDA state: ranks are forked by a fork server that has imported
    # the worker (torch) and nothing more, so a rank starts without importing it again (~1.5 s of CPU a
    # rank; an idle 8-rank replica on two cores: ready in 6 s instead of 11). The fork server keeps the
    # environment it started with: each rank takes this process's as it is now.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["engine.worker"])
    procs = []
    for rank in ranks:
        # daemonic: ended with their parent even where it cannot say goodbye
        proc = ctx.Process(target=run_worker, args=(rank, config, model_config, path, max_model_len, init_method,
                                                    dict(os.environ)),
                           name=f"rank{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    return procs


def _free_local_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
