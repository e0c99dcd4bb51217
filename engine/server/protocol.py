"""The OpenAI wire format we speak: a deliberate subset of requests (the rest is a 400) and the responses.

Request fields left as None take OpenAI's defaults; several clients send explicit nulls.
"""

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

# ----------------------------------------------------------------------------------------------- requests


class _Strict(BaseModel):
    # Unknown fields are a 400 that names them, never silently ignored.
    # Strict: `"max_tokens": true` or `"n": "2"` is a wrong type, not something to guess at.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    # Parsed only to answer with a clear "no vision input" error.
    type: Literal["image_url"]
    image_url: Any


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class SystemMessage(_Strict):
    role: Literal["system", "developer"]  # "developer" is OpenAI's newer name for the system role
    content: str | list[TextPart]


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[ContentPart]


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[TextPart]
    # Clients echo a previous response's message back; DeepSeek's templates drop old reasoning anyway.
    reasoning_content: str | None = None
    # Fields of OpenAI's response message, accepted only empty: this server does no tool calling.
    refusal: None = None
    tool_calls: list | None = None
    function_call: None = None
    audio: None = None
    annotations: list | None = None

    @field_validator("tool_calls", "annotations")
    @classmethod
    def _empty(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tool calls and annotations are not supported by this server")
        return value


Message = Annotated[SystemMessage | UserMessage | AssistantMessage, Field(discriminator="role")]


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _SamplingFields(_Strict):
    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # extension (vLLM, SGLang); -1 or 0: off
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    n: Annotated[int, Field(ge=1, le=64)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    ignore_eos: bool | None = None  # extension: generate exactly max_tokens (benchmarks)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as the issue asks


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] | None = None
    suffix: None = None
    best_of: Literal[1] | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt_error(cls, value: Any, handler: Any) -> Any:
        # One clear message instead of one error per member of the union.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                "must be a string, a non-empty list of strings, a non-empty list of token ids (ints >= 0) "
                "or a non-empty list of such lists"
            ) from None


# ---------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_reasoning(self, handler: Any) -> dict:
        data = handler(self)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


def _created() -> int:
    return int(time.time())


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """Only the keys that changed, as OpenAI streams them."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class _MaybeUsage(BaseModel):
    # Streamed chunks carry "usage" (null until the last chunk) only when the client asked for it.
    usage: Usage | None = None
    include_usage: bool = Field(True, exclude=True)

    @model_serializer(mode="wrap")
    def _drop_usage(self, handler: Any) -> dict:
        data = handler(self)
        usage = data.pop("usage", None)
        if self.include_usage:
            data["usage"] = usage  # last, where OpenAI puts it
        return data


class ChatCompletionChunk(_MaybeUsage):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(_MaybeUsage):
    """A whole completion, or one streamed chunk of it (same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "deepseek-fleet"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
