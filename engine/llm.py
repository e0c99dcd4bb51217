"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

import itertools

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Batch generation in-process. `model` is a checkpoint directory or `deepseek-tiny`."""

    def __init__(self, model: str = "deepseek-tiny", dtype: str = "auto", **engine_args):
        engine_args.setdefault("show_progress", False)
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm)

    def score(self, prompts: list[Prompt]) -> list[torch.Tensor]:
        """Logits [len(prompt), vocab] (float32, on the CPU) for every prompt position, through the serving path."""
        params = [SamplingParams(temperature=0.0, max_tokens=1) for _ in prompts]
        ids = self._submit(prompts, params, collect_logits=True)
        seqs = [self.engine.requests[i] for i in ids]
        self._drain(len(ids), False)
        return [torch.cat(s.prompt_logits)[: s.num_prompt_tokens].cpu() for s in seqs]

    def _submit(self, prompts, params_list, collect_logits=False) -> list[str]:
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, params, collect_logits=collect_logits)
                ids.append(rid)
        except Exception:
            for rid in ids:  # all or nothing: no half-submitted batch stays queued
                self.engine.abort_request(rid)
            raise
        return ids

    def _drain(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return finished

    def _run(self, prompts, params_list, use_tqdm) -> list[RequestOutput]:
        ids = self._submit(prompts, params_list)
        finished = self._drain(len(ids), use_tqdm)
        return [finished[i] for i in ids]
