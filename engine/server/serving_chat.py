"""POST /v1/chat/completions: messages (+ tools) -> chat template -> engine -> a completion or an SSE stream."""

import functools
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from engine.multimodal import ImageError, ImageInput, place_images
from engine.outputs import RequestOutput
from engine.server.errors import InvalidRequest
from engine.server.images import ImageLoader, ImageSettings
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
    NamedToolChoice,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    ToolCallFunctionDelta,
    TopLogprob,
)
from engine.server import structured, tool_format
from engine.server.reasoning import THINK_END, THINK_START, ReasoningParser
from engine.server.request_stream import RequestStream
from engine.server.serving import Serving, check_not_aborted, clamp_logprob, run_to_completion
from engine.server.sse import SSE_DONE, ChunkFrames, EventStreamResponse, sse
from engine.server.tool_format import ToolFormat
from engine.server.tool_parser import ToolCallParser


# how an image part is written into the prompt text when the tokenizer has no token for the model's
# image_token_id (V4.1's spelling); the text is split there, so the spelling only has to be unusual
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"


class ChatServing(Serving):
    """Chat completions, streamed or whole, with DeepSeek's reasoning split out of the answer."""

    def __init__(self, engine, served_model_name: str, image_settings: ImageSettings = ImageSettings()) -> None:
        super().__init__(engine, served_model_name)
        self.images = ImageLoader(image_settings)

    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(request.model)
        include_usage = self.check_stream_options(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
        tool_choice = self.check_tools(request)
        n = request.n or 1
        self.check_choices(n)  # before templating a long history
        size = sum(_text_size(m) for m in request.messages) + sum(len(repr(t)) for t in request.tools or ())
        prompt, image_parts = await self.off_the_loop(self.render, request, size=size)
        images = await self.load_images(image_parts)
        # the template wrote BOS; encode() does not repeat it
        prompt_ids = await self.off_the_loop(self.encode, prompt, images, size=len(prompt))
        max_tokens = request.max_completion_tokens or request.max_tokens
        max_tokens = self.check_context(len(prompt_ids), max_tokens, "messages")
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        constraint = structured.for_chat(
            response_format=request.response_format, tools=request.tools, tool_choice=tool_choice,
            parallel=request.parallel_tool_calls is not False, fmt=self.tool_format, prompt=prompt,
            think_tokens=self.think_tokens,
        )
        params = [self.sampling_params(request, max_tokens, num_logprobs, i, constraint) for i in range(n)]
        stream = await self.submit(f"chatcmpl-{uuid.uuid4().hex}", [prompt_ids] * n, params, raw, "messages", images)
        parse_calls = request.tools is not None and tool_choice != "none"
        max_calls = None if request.parallel_tool_calls is not False else 1
        reply = _Reply(self, stream.request_id, prompt, n, num_logprobs, self.tool_format if parse_calls else None,
                       max_calls)
        if request.stream:
            return EventStreamResponse(reply.events(stream, prompt_ids, include_usage), stream)
        return await run_to_completion(raw, stream, lambda final: reply.whole(final, prompt_ids))

    @functools.cached_property
    def tool_format(self) -> ToolFormat | None:
        """How the served model's chat template writes tool calls (None: it writes none we can parse)."""
        return tool_format.detect(self.tokenizer)

    @functools.cached_property
    def think_tokens(self) -> bool:
        """Whether `<think>` and `</think>` are single tokens (a grammar can then place the reasoning)."""
        return all(len(self.tokenizer.encode(tag, add_bos=False)) == 1 for tag in (THINK_START, THINK_END))

    def check_tools(self, request: ChatCompletionRequest) -> str | NamedToolChoice:
        """The request's tool_choice (OpenAI's defaults filled in); a 400 for tools this server cannot serve."""
        tools, choice = request.tools, request.tool_choice
        if tools is None:
            if choice not in (None, "none", "auto"):
                raise InvalidRequest("tool_choice requires tools.", param="tool_choice")
            return "none"
        if self.tool_format is None:
            raise InvalidRequest(
                f"The served model `{self.served_model_name}` has no tool-call format this server knows: its chat "
                "template writes no DeepSeek tool calls (<｜tool▁call▁begin｜>...).", param="tools",
            )
        names = [t.function.name for t in tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise InvalidRequest(f"Function names must be unique; repeated: {', '.join(duplicates)}.", param="tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequest(
                f"tool_choice names the function `{choice.function.name}`, which is not in tools "
                f"({', '.join(names)}).", param="tool_choice",
            )
        return "auto" if choice is None else choice

    @property
    def image_placeholder(self) -> str:
        """The text an image part becomes in the rendered prompt (the image token's, where it has one)."""
        return self.tokenizer.id_to_token(self.engine.vision.image_token_id) or IMAGE_PLACEHOLDER

    async def load_images(self, parts: list[tuple[str, str]]) -> list[ImageInput]:
        """(param, url) of each image part -> the images, decoded and cut into patches; a 400 naming the part
        that fails, and why."""
        if not parts:
            return []
        try:
            return await self.images.load([url for _, url in parts], self.engine.vision)
        except ImageError as exc:
            index = getattr(exc, "index", None)
            raise InvalidRequest(f"Invalid image: {exc}.", param=parts[index][0] if index is not None else "messages",
                                 code="invalid_image") from None

    def encode(self, prompt: str, images: list[ImageInput]) -> list[int]:
        """Prompt ids; each image placeholder in the text becomes its image's span of image token ids."""
        if not images:
            return self.tokenizer.encode(prompt)
        pieces = prompt.split(self.image_placeholder)
        if len(pieces) != len(images) + 1:
            raise InvalidRequest(f"The messages' text contains the image placeholder {self.image_placeholder} "
                                 "itself; it may only come from image_url parts.", param="messages")
        token = self.engine.vision.image_token_id
        ids = self.tokenizer.encode(pieces[0])
        for piece in pieces[1:]:
            ids += [token] + self.tokenizer.encode(piece, add_bos=False)
        return place_images(ids, images, token)

    def render(self, request: ChatCompletionRequest) -> tuple[str, list[tuple[str, str]]]:
        """The prompt text, and (param, url) of each image part in the order they appear in it."""
        messages, images = [], []
        for i, message in enumerate(request.messages):
            content = message.content
            if content is not None and not isinstance(content, str):
                texts = []
                for j, part in enumerate(content):
                    if isinstance(part, ImagePart):
                        if self.engine.vision is None:
                            raise InvalidRequest(
                                f"The served model `{self.served_model_name}` has no vision input; "
                                "image content parts are not supported.",
                                param=f"messages[{i}].content[{j}]",
                            )
                        images.append((f"messages[{i}].content[{j}]", part.image_url.url))
                        texts.append(self.image_placeholder)
                    else:
                        texts.append(part.text)
                content = "\n".join(texts)
            role = "system" if message.role == "developer" else message.role
            rendered = {"role": role, "content": content}
            if role == "assistant" and message.tool_calls:
                rendered["tool_calls"] = [call.model_dump(exclude={"index"}) for call in message.tool_calls]
                rendered["content"] = content or None  # DeepSeek's templates write calls after null content
            elif role == "tool":
                rendered["tool_call_id"] = message.tool_call_id
            messages.append(rendered)
        kwargs = dict(request.chat_template_kwargs or {})
        if request.tools is not None:
            tools = [tool.model_dump(exclude_unset=True) for tool in request.tools]
            if "tools" in self.tokenizer.chat_template_variables:
                kwargs["tools"] = tools  # the template renders them itself, as transformers passes them
            else:  # DeepSeek's own templates do not: the tools go into the system prompt, as its model card lays out
                last_system = max((i for i, m in enumerate(messages) if m["role"] == "system"), default=-1)
                messages.insert(last_system + 1, {"role": "system", "content": self.tool_format.tools_prompt(tools)})
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs), images
        except Exception as exc:  # noqa: BLE001 - a template error (jinja, bad kwargs) is the request's fault
            raise InvalidRequest(
                f"The chat template could not render these messages: {type(exc).__name__}: {exc}",
                param="chat_template_kwargs" if isinstance(exc, TypeError) else "messages",
            ) from None


def _text_size(message) -> int:
    """About how many characters a message adds to the prompt (to choose whether to template off the loop)."""
    content = message.content
    size = 0 if content is None else len(content) if isinstance(content, str) else sum(
        len(getattr(part, "text", "")) for part in content)
    for call in getattr(message, "tool_calls", None) or ():
        size += len(call.function.arguments)
    return size


class _Reply:
    """Builds one request's response: the chunks of a stream, or the whole completion."""

    def __init__(
        self, serving: ChatServing, request_id: str, prompt: str, n: int, num_logprobs: int | None,
        fmt: ToolFormat | None, max_calls: int | None,
    ) -> None:
        self.serving = serving
        self.id = request_id
        self.n = n
        self.num_logprobs = num_logprobs
        self.model = serving.served_model_name
        self.created = int(time.time())
        self.parsers = [ReasoningParser.for_prompt(prompt) for _ in range(n)]
        # tool calls are parsed out of the answer (not the reasoning) when the model may call
        self.tool_parsers = [ToolCallParser(fmt, max_calls) if fmt is not None else None for _ in range(n)]

    def split(self, index: int, text: str, finished: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, tool-call deltas) of a text delta of choice `index`."""
        parser, tool_parser = self.parsers[index], self.tool_parsers[index]
        if parser is None:
            reasoning, content = "", text
        else:
            reasoning, content = parser.feed(text)
            if finished:
                more_reasoning, more_content = parser.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if tool_parser is None:
            return reasoning, content, []
        content, deltas = tool_parser.feed(content)
        if finished:
            more_content, more_deltas = tool_parser.finish()
            content, deltas = content + more_content, deltas + more_deltas
        return reasoning, content, [
            ToolCallDelta(index=d.index, id=d.id, type="function" if d.id else None,
                          function=ToolCallFunctionDelta(name=d.name, arguments=d.arguments))
            for d in deltas
        ]

    def finish_reason(self, index: int, out: RequestOutput) -> str | None:
        """OpenAI's "tool_calls" for an output that ended (not cut short) after calling tools."""
        tool_parser = self.tool_parsers[index]
        if out.finish_reason == "stop" and tool_parser is not None and tool_parser.calls:
            return "tool_calls"
        return out.finish_reason

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
            reasoning, content, _ = self.split(index, out.text, finished=True)
            parser, tool_parser = self.parsers[index], self.tool_parsers[index]
            calls = [ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
                     for c in (tool_parser.calls if tool_parser is not None else ())]
            message = ChatMessage(
                content=None if calls and not content.strip() else content,
                reasoning_content=reasoning if parser is not None and parser.saw_reasoning else None,
                tool_calls=calls or None,
            )
            logprobs = self.logprobs(out, 0)
            choices.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                      finish_reason=self.finish_reason(index, out)))
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

        frames = ChunkFrames("chat.completion.chunk", self.id, self.created, self.model, include_usage)
        for index in range(self.n):
            yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
        num_chars = [0] * self.n  # text already sent, per choice
        num_tokens = [0] * self.n  # tokens whose logprobs were sent, per choice
        final: dict[int, RequestOutput] = {}
        async for batch in stream:
            for index, out in batch.items():
                check_not_aborted(out)
                reasoning, content, calls = self.split(index, out.text[num_chars[index] :], out.finished)
                logprobs = self.logprobs(out, num_tokens[index])
                num_chars[index], num_tokens[index] = len(out.text), len(out.token_ids)
                if (reasoning or content) and not calls and logprobs is None:
                    yield frames.chat_delta(index, content or None, reasoning or None)
                elif reasoning or content or calls or (logprobs is not None and logprobs.content):
                    # Content "" (not absent) when only logprobs arrived: a token whose text is still held back.
                    content = content or (None if reasoning or calls else "")
                    delta = ChatDelta(content=content, reasoning_content=reasoning or None, tool_calls=calls or None)
                    yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])
                if out.finished:
                    final[index] = out
                    reason = self.finish_reason(index, out)
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)])
        if include_usage:
            yield chunk([], self.serving.usage([prompt_ids], final, self.n))
        yield SSE_DONE
