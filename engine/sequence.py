"""One request's scheduling state as it moves through the scheduler (its text, detokenizer and logprobs
live in the output processor)."""

import enum
import time

import numpy as np
import torch

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None = None, images: list | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # engine.multimodal.ImageInput of the prompt, each on its span of placeholder ids, in order
        self.images = list(images or ())
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or written by a step in flight)
        self.num_inflight_tokens = 0  # drawn by launched steps, not yet read by the host (0-2)
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first admission)
        self.remote_span = (0, 0)  # token range [start, end) whose blocks were pulled from a peer
        self.pinned_blocks: list[int] = []  # pulled blocks held for this sequence until it is admitted
        self.generator = generator
        # the seed a sampled token's noise is keyed by, with its output position (engine.sampler)
        self.seed = generator.initial_seed() if generator is not None else 0
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.collect_logits = False  # keep every position's logits (LLM.score)
        self.prompt_logits: list[torch.Tensor] | None = None
        self.guide = None  # engine.structured_output.Guide: what the output may continue with
        self.draft_token_ids: list[int] = []  # speculative tokens the next step verifies (MTP drafts)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_drawn_tokens(self) -> int:
        """Prompt and output tokens, counting those drawn by steps still in flight (ids the host has not
        read yet): a chunk that reaches this far samples the next token."""
        return self.num_tokens + self.num_inflight_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def image_key(self, start: int, end: int) -> bytes:
        """What the prefix cache keys tokens [start, end) by besides their ids: the content hash of each
        image whose span they cover, with where the span starts relative to `start` (b"" for text)."""
        key = b""
        for image in self.images:
            first, stop = image.span
            if first < end and stop > start:
                key += image.content_hash + np.int64(first - start).tobytes()
        return key

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        end = self.num_tokens if end is None else end
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
