"""POST /v1/completions: prompt(s) as text or token ids -> engine -> a completion or an SSE stream."""

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.server import structured
from engine.server.protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from engine.server.request_stream import RequestStream
from engine.server.serving import Serving, check_not_aborted, clamp_logprob, run_to_completion
from engine.server.sse import SSE_DONE, ChunkFrames, EventStreamResponse, sse

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


class CompletionServing(Serving):
    """Legacy completions: several prompts per request, n choices each (choice index = prompt * n + j)."""

    async def create(self, request: CompletionRequest, raw: Request) -> Response:
        self.check_model(request.model)
        include_usage = self.check_stream_options(request)
        n = request.n or 1
        num_prompts = 1 if isinstance(request.prompt, str) or isinstance(request.prompt[0], int) else len(request.prompt)
        self.check_choices(num_prompts * n)  # before tokenizing thousands of prompts
        size = len(request.prompt) if isinstance(request.prompt, str) else sum(
            len(p) if isinstance(p, str) else 0 for p in request.prompt)
        prompts = await self.off_the_loop(self.tokenize, request.prompt, size=size)
        max_tokens = request.max_tokens or DEFAULT_MAX_TOKENS
        for prompt_ids in prompts:
            self.check_context(len(prompt_ids), max_tokens, "prompt")
        choice_prompts = [p for p in prompts for _ in range(n)]
        constraint = structured.for_completion(request.response_format)
        params = [self.sampling_params(request, max_tokens, request.logprobs, i, constraint)
                  for i in range(len(choice_prompts))]
        stream = await self.submit(f"cmpl-{uuid.uuid4().hex}", choice_prompts, params, raw, "prompt")
        reply = _Reply(self, stream.request_id, request.logprobs)
        if request.stream:
            return EventStreamResponse(reply.events(stream, prompts, n, include_usage), stream)
        return await run_to_completion(raw, stream, lambda final: reply.whole(final, prompts, n))

    def tokenize(self, prompt: str | list) -> list[list[int]]:
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt[0], str):
            texts = prompt
        else:  # token ids: the engine checks them against the vocabulary
            return [prompt] if isinstance(prompt[0], int) else prompt
        return [self.tokenizer.encode(text) for text in texts]


class _Reply:
    def __init__(self, serving: CompletionServing, request_id: str, num_logprobs: int | None) -> None:
        self.serving = serving
        self.id = request_id
        self.num_logprobs = num_logprobs
        self.model = serving.served_model_name
        self.created = int(time.time())

    def logprobs(self, out: RequestOutput, start: int, text_start: int) -> CompletionLogprobs | None:
        if self.num_logprobs is None or out.logprobs is None:
            return None
        token_text = self.serving.token_text
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        offset = text_start
        for token_id, lps in zip(out.token_ids[start:], out.logprobs[start:]):
            text = token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(clamp_logprob(lps[token_id]))
            result.top_logprobs.append(
                {token_text(t): clamp_logprob(lp) for t, lp in self.serving.top_logprobs(lps, self.num_logprobs)}
            )
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def whole(self, final: dict[int, RequestOutput], prompts: list[list[int]], n: int) -> Completion:
        choices = [
            CompletionChoice(index=i, text=out.text, logprobs=self.logprobs(out, 0, 0), finish_reason=out.finish_reason)
            for i, out in sorted(final.items())
        ]
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=self.serving.usage(prompts, final, n),
        )

    async def events(
        self, stream: RequestStream, prompts: list[list[int]], n: int, include_usage: bool
    ) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage=None) -> str:
            return sse(
                Completion(
                    id=self.id, created=self.created, model=self.model, choices=choices,
                    usage=usage, include_usage=include_usage,
                )
            )

        frames = ChunkFrames("text_completion", self.id, self.created, self.model, include_usage)
        num_choices = len(prompts) * n
        num_chars, num_tokens = [0] * num_choices, [0] * num_choices
        final: dict[int, RequestOutput] = {}
        async for batch in stream:
            for index, out in batch.items():
                check_not_aborted(out)
                text = out.text[num_chars[index] :]
                logprobs = self.logprobs(out, num_tokens[index], num_chars[index])
                num_chars[index], num_tokens[index] = len(out.text), len(out.token_ids)
                if out.finished:
                    final[index] = out
                if logprobs is None and (text or out.finished):
                    yield frames.completion_text(index, text, out.finish_reason if out.finished else None)
                elif text or out.finished or (logprobs is not None and logprobs.tokens):
                    reason = out.finish_reason if out.finished else None
                    yield chunk([CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason)])
        if include_usage:
            yield chunk([], self.serving.usage(prompts, final, n))
        yield SSE_DONE
