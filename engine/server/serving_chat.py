"""POST /v1/chat/completions: messages -> chat template -> engine -> a completion or an SSE stream."""

import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import RequestOutput
from engine.server.errors import InvalidRequest
from engine.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ImagePart,
    TokenLogprob,
    TopLogprob,
)
from engine.server.reasoning import ReasoningParser
from engine.server.request_stream import RequestStream
from engine.server.serving import Serving, check_not_aborted, clamp_logprob, run_to_completion
from engine.server.sse import SSE_DONE, EventStreamResponse, sse


class ChatServing(Serving):
    """Chat completions, streamed or whole, with DeepSeek's reasoning split out of the answer."""

    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(request.model)
        include_usage = self.check_stream_options(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
        n = request.n or 1
        self.check_choices(n)  # before templating a long history
        size = sum(len(m.content) if isinstance(m.content, str) else sum(len(getattr(part, "text", "")) for part in m.content)
                   for m in request.messages)
        prompt = await self.off_the_loop(self.render, request, size=size)
        # the template wrote BOS; encode() does not repeat it
        prompt_ids = await self.off_the_loop(self.tokenizer.encode, prompt, size=len(prompt))
        max_tokens = request.max_completion_tokens or request.max_tokens
        max_tokens = self.check_context(len(prompt_ids), max_tokens, "messages")
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = [self.sampling_params(request, max_tokens, num_logprobs, i) for i in range(n)]
        stream = await self.submit(f"chatcmpl-{uuid.uuid4().hex}", [prompt_ids] * n, params, raw, "messages")
        reply = _Reply(self, stream.request_id, prompt, n, num_logprobs)
        if request.stream:
            return EventStreamResponse(reply.events(stream, prompt_ids, include_usage), stream)
        return await run_to_completion(raw, stream, lambda final: reply.whole(final, prompt_ids))

    def render(self, request: ChatCompletionRequest) -> str:
        messages = []
        for i, message in enumerate(request.messages):
            content = message.content
            if not isinstance(content, str):
                for j, part in enumerate(content):
                    if isinstance(part, ImagePart):
                        raise InvalidRequest(
                            f"The served model `{self.served_model_name}` has no vision input; "
                            "image content parts are not supported.",
                            param=f"messages[{i}].content[{j}]",
                        )
                content = "\n".join(part.text for part in content)
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": content})
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, **(request.chat_template_kwargs or {})
            )
        except Exception as exc:  # noqa: BLE001 - a template error (jinja, bad kwargs) is the request's fault
            raise InvalidRequest(
                f"The chat template could not render these messages: {type(exc).__name__}: {exc}",
                param="chat_template_kwargs" if isinstance(exc, TypeError) else "messages",
            ) from None


class _Reply:
    """Builds one request's response: the chunks of a stream, or the whole completion."""

    def __init__(self, serving: ChatServing, request_id: str, prompt: str, n: int, num_logprobs: int | None) -> None:
        self.serving = serving
        self.id = request_id
        self.n = n
        self.num_logprobs = num_logprobs
        self.model = serving.served_model_name
        self.created = int(time.time())
        self.parsers = [ReasoningParser.for_prompt(prompt) for _ in range(n)]

    def split(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of a text delta of choice `index`."""
        parser = self.parsers[index]
        if parser is None:
            return "", text
        reasoning, content = parser.feed(text)
        if finished:
            more_reasoning, more_content = parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def logprobs(self, out: RequestOutput, start: int) -> ChatLogprobs | None:
        if self.num_logprobs is None or out.logprobs is None:
            return None
        token_text = self.serving.token_text
        content = []
        for token_id, lps in zip(out.token_ids[start:], out.logprobs[start:]):
            text = token_text(token_id)
            top = [
                TopLogprob(token=token_text(t), logprob=clamp_logprob(lp), bytes=list(token_text(t).encode()))
                for t, lp in self.serving.top_logprobs(lps, self.num_logprobs)
            ]
            content.append(
                TokenLogprob(
                    token=text, logprob=clamp_logprob(lps[token_id]), bytes=list(text.encode()), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)

    def whole(self, final: dict[int, RequestOutput], prompt_ids: list[int]) -> ChatCompletion:
        choices = []
        for index in range(self.n):
            out = final[index]
            reasoning, content = self.split(index, out.text, finished=True)
            parser = self.parsers[index]
            message = ChatMessage(
                content=content, reasoning_content=reasoning if parser is not None and parser.saw_reasoning else None
            )
            logprobs = self.logprobs(out, 0)
            choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=out.finish_reason))
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=self.serving.usage([prompt_ids], final, self.n),
        )

    async def events(self, stream: RequestStream, prompt_ids: list[int], include_usage: bool) -> AsyncIterator[str]:
        def chunk(choices: Sequence[ChatChunkChoice], usage=None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=self.id, created=self.created, model=self.model, choices=list(choices),
                    usage=usage, include_usage=include_usage,
                )
            )

        for index in range(self.n):
            yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
        num_chars = [0] * self.n  # text already sent, per choice
        num_tokens = [0] * self.n  # tokens whose logprobs were sent, per choice
        final: dict[int, RequestOutput] = {}
        async for batch in stream:
            for index, out in batch.items():
                check_not_aborted(out)
                reasoning, content = self.split(index, out.text[num_chars[index] :], out.finished)
                logprobs = self.logprobs(out, num_tokens[index])
                num_chars[index], num_tokens[index] = len(out.text), len(out.token_ids)
                if reasoning or content or (logprobs is not None and logprobs.content):
                    # Content "" (not absent) when only logprobs arrived: a token whose text is still held back.
                    content = content or (None if reasoning else "")
                    delta = ChatDelta(content=content, reasoning_content=reasoning or None)
                    yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])
                if out.finished:
                    final[index] = out
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=out.finish_reason)])
        if include_usage:
            yield chunk([], self.serving.usage([prompt_ids], final, self.n))
        yield SSE_DONE
