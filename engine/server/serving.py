"""What chat and completions share: admission checks, sampling settings, running a request to its end."""

import asyncio
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.async_engine import AsyncEngine, PromptTooLong
from engine.server.disconnect import until_disconnected
from engine.server.errors import ContextLengthExceeded, InternalError, InvalidRequest, ModelNotFound
from engine.server.protocol import PromptTokensDetails, Usage
from engine.server.request_stream import RequestStream
from engine.structured_output import StructuredOutput
from engine.tokenizer import LONG_TEXT_CHARS

T = TypeVar("T")

# OpenAI reports tokens outside the sampling set (top-p/top-k cut) as -9999.0; JSON has no -inf.
MIN_LOGPROB = -9999.0
MAX_CHOICES = 256  # prompts x n per request: more is refused before anything is tokenized


class Serving:
    """Base of the chat and completions services; holds the engine and the served model's name."""

    async def off_the_loop(self, fn: Callable, *args, size: int = 0) -> Any:
        """fn(*args), in a thread when its input is large (a long prompt's template or tokenization would
        hold every other stream's event loop for milliseconds); inline when small (a thread hop costs more)."""
        if size > LONG_TEXT_CHARS:  # the size from which the tokenizer releases the GIL too
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @functools.cached_property
    def token_text(self) -> Callable[[int], str]:
        """Text of one token id (cached: logprobs ask for the same ids again and again)."""
        return functools.lru_cache(maxsize=1 << 16)(lambda token_id: self.tokenizer.decode([token_id]))

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise ModelNotFound(
                f"The model `{model}` does not exist; this server serves `{self.served_model_name}`.",
                param="model",
            )

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, what: str) -> int:
        """The max_tokens to generate; a 400 context_length_exceeded when the request cannot fit."""
        limit = self.max_model_len
        if max_tokens is None and num_prompt_tokens < limit:
            return limit - num_prompt_tokens
        if max_tokens is not None and num_prompt_tokens + max_tokens <= limit:
            return max_tokens
        if max_tokens is None:
            detail = f"However, your {what} resulted in {num_prompt_tokens} tokens."
        else:
            detail = (
                f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the {what}, {max_tokens} in the completion)."
            )
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. {detail} "
            f"Please reduce the length of the {what} or completion.",
            param=what,
        )

    @staticmethod
    def sampling_params(
        request: Any, max_tokens: int, logprobs: int | None, choice: int, constraint: StructuredOutput | None = None
    ) -> SamplingParams:
        """SamplingParams of one choice; choice i of a seeded request uses seed + i (distinct, reproducible).
        `constraint`: what the output must match (response_format, tool_choice)."""
        extra = {} if constraint is None else {"structured_output": constraint}
        try:
            return SamplingParams(
                temperature=_default(request.temperature, 1.0),
                top_p=_default(request.top_p, 1.0),
                top_k=-1 if not request.top_k else request.top_k,
                seed=None if request.seed is None else (request.seed + choice) % (1 << 63),
                max_tokens=max_tokens,
                stop=request.stop,
                ignore_eos=bool(request.ignore_eos),
                logprobs=logprobs,
                presence_penalty=_default(request.presence_penalty, 0.0),
                frequency_penalty=_default(request.frequency_penalty, 0.0),
                **extra,
            )
        except ValueError as exc:
            name = re.search(r"parameter (\w+)=", str(exc))
            raise InvalidRequest(str(exc), param=name.group(1) if name else None) from None

    def check_stream_options(self, request: Any) -> bool:
        """Whether to send a usage chunk; stream_options without stream is a 400, as at OpenAI."""
        if request.stream_options is not None and not request.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true.", param="stream_options")
        return bool(request.stream and request.stream_options and request.stream_options.include_usage)

    @staticmethod
    def check_choices(num_choices: int) -> None:
        if num_choices > MAX_CHOICES:
            raise InvalidRequest(f"A request may carry at most {MAX_CHOICES} choices (prompts x n); this one has "
                                 f"{num_choices}.", param="n")

    async def submit(
        self, request_id: str, prompts: Sequence[list[int]], params: Sequence[SamplingParams], raw: Request, what: str,
        images: list | None = None,
    ) -> RequestStream:
        """Hands the choices to the engine; the engine's refusal becomes a 400 about `what` (the prompt)."""
        self.check_choices(len(prompts))
        stream = self.engine.submit(request_id, prompts, params, images)
        try:
            await until_disconnected(raw, stream.admitted())
        except PromptTooLong as exc:
            raise ContextLengthExceeded(str(exc), param=what) from None
        except ValueError as exc:
            raise InvalidRequest(str(exc), param=what) from None
        except BaseException:
            stream.close()
            raise
        return stream

    def usage(self, prompts: Sequence[list[int]], outputs: dict[int, RequestOutput], n: int) -> Usage:
        """Usage of a request of `prompts` x `n` choices: each prompt counted once, as OpenAI does."""
        num_prompt = sum(len(p) for p in prompts)
        num_completion = sum(len(out.token_ids) for out in outputs.values())
        # A prompt's cached tokens: what every one of its choices got from the cache.
        num_cached = sum(
            min((outputs[p * n + j].num_cached_tokens for j in range(n) if p * n + j in outputs), default=0)
            for p in range(len(prompts))
        )
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        )

    def top_logprobs(self, logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
        return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]


async def collect(stream: RequestStream) -> dict[int, RequestOutput]:
    """Every choice's final output."""
    final: dict[int, RequestOutput] = {}
    async for batch in stream:
        final.update(batch)
    for out in final.values():
        check_not_aborted(out)
    return final


def check_not_aborted(out: RequestOutput) -> None:
    if out.finish_reason == "abort":
        raise InternalError("The engine aborted this request.")


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


async def run_to_completion(
    raw: Request, stream: RequestStream, build: Callable[[dict[int, RequestOutput]], BaseModel]
) -> Response:
    """A whole (non-streamed) response; a client that leaves early aborts the generation."""
    try:
        final = await until_disconnected(raw, collect(stream))
    finally:
        stream.close()
    return Response(build(final).model_dump_json(), media_type="application/json")
