"""The OpenAI wire format we speak: a deliberate subset of requests (the rest is a 400) and the responses.

Request fields left as None take OpenAI's defaults; several clients send explicit nulls.
"""

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

# ----------------------------------------------------------------------------------------------- requests


class _Strict(BaseModel):
    # Unknown fields are a 400 that names them, never silently ignored.
    # Strict: `"max_tokens": true` or `"n": "2"` is a wrong type, not something to guess at.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # data:image/png;base64,... or, when the server fetches them, an http(s) URL
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's own resize plan applies


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class SystemMessage(_Strict):
    role: Literal["system", "developer"]  # "developer" is OpenAI's newer name for the system role
    content: str | list[TextPart]


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[ContentPart]


# OpenAI's rule for function and schema names.
Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as a string


class AssistantToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall
    index: int | None = None  # what the SDKs' stream accumulators leave on a streamed call; ignored


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None  # null when the turn only called tools
    tool_calls: list[AssistantToolCall] | None = None
    # Clients echo a previous response's message back; DeepSeek's templates drop old reasoning anyway.
    reasoning_content: str | None = None
    # Fields of OpenAI's response message, accepted only empty.
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list | None = None

    @field_validator("annotations")
    @classmethod
    def _empty(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("annotations are not supported by this server")
        return value

    @model_validator(mode="after")
    def _content_or_calls(self) -> "AssistantMessage":
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(_Strict):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; none: no parameters
    strict: bool | None = None  # true: the arguments are enforced to match even when the model may answer instead


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    type: Literal["json_object"]


class JSONSchema(_Strict):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # accepted; the schema is enforced either way


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


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
    response_format: ResponseFormat | None = None  # on completions an extension (vLLM's)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # default true

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _one_tool_choice_error(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
            ) from None


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


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict:
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
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


class _OnlySet(BaseModel):
    """Only the keys that changed, as OpenAI streams them."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallFunctionDelta(_OnlySet):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_OnlySet):
    """A call's first delta has its id, type and name; the later ones carry argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta | None = None


class ChatDelta(_OnlySet):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
