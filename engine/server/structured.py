"""What a request's output must match (`response_format`, `tool_choice`), as the engine's StructuredOutput.

A chat request gets a Lark grammar when it constrains tool calls or reasons first: an optional reasoning part
up to `</think>` (when the prompt opens one, or may), then the answer (any text, or JSON), tool calls of the
allowed functions (each `%json{<its parameters>}`), or either. Text lexemes never take special tokens (llguidance),
so an answer cannot slip into a tool call, nor a reasoning part past `</think>`.
"""

from typing import Any

from engine.server.errors import InvalidRequest
from engine.server.protocol import JSONObjectFormat, JSONSchemaFormat, NamedToolChoice, ResponseFormat, Tool
from engine.server.reasoning import THINK_END, THINK_START
from engine.server.tool_format import NO_PARAMETERS, ToolFormat, lark_json
from engine.structured_output import StructuredOutput, StructuredOutputError

TEXT = "/(?s:.+)/"  # any text without special tokens
ANY_OBJECT = {"type": "object"}


def answer_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema the answer must match (checked: a 400 naming what cannot be enforced); None: any text."""
    if isinstance(response_format, JSONObjectFormat):
        return ANY_OBJECT
    if isinstance(response_format, JSONSchemaFormat):
        schema = response_format.json_schema.schema_
        check_schema(schema, "response_format.json_schema.schema")
        return schema
    return None


def for_completion(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """/v1/completions: the text must match response_format's JSON (no chat template, no reasoning)."""
    schema = answer_schema(response_format)
    return None if schema is None else _json(schema)


def _json(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(json_object=True) if schema is ANY_OBJECT else StructuredOutput(json_schema=schema)


def for_chat(
    *,
    response_format: ResponseFormat | None,
    tools: list[Tool] | None,
    tool_choice: str | NamedToolChoice,
    parallel: bool,
    fmt: ToolFormat | None,
    prompt: str,
    think_tokens: bool,
) -> StructuredOutput | None:
    """The chat answer's constraint; None when the output is free (no response_format; tool_choice auto
    without strict functions: calls are parsed, not enforced). `fmt`: the model's tool format (given with
    tools); `think_tokens`: `<think>` and `</think>` are single tokens of the model."""
    schema = answer_schema(response_format)
    has_tools = bool(tools) and fmt is not None
    must_call = has_tools and tool_choice not in ("auto", "none")
    enforce_calls = must_call or (has_tools and tool_choice == "auto"
                                  and (schema is not None or any(t.function.strict for t in tools)))
    never_call = has_tools and tool_choice == "none"
    if not (enforce_calls or never_call or schema is not None):
        return None
    think = _think_prefix(prompt) if think_tokens else ""
    if not enforce_calls and not think and schema is not None:
        return _json(schema)
    answer = "TEXT?" if schema is None else lark_json(schema)
    body, calls = answer, ""
    if enforce_calls:
        named = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
        functions = []
        for i, tool in enumerate(tools):
            if named in (None, tool.function.name):
                parameters = tool.function.parameters or {**NO_PARAMETERS, "additionalProperties": False}
                check_schema(parameters, f"tools[{i}].function.parameters")
                functions.append((tool.function.name, parameters))
        # an answer in JSON or the calls (llguidance cannot end a JSON answer that text before calls could continue)
        body = "calls" if must_call else f"{answer} | TEXT? calls" if schema is None else f"{answer} | calls"
        calls = fmt.lark_calls(functions, parallel)
    rules = [f"start: {think}body", f"body: {body}", calls]
    if "TEXT" in body:
        rules.append(f"TEXT: {TEXT}")
    if think:
        rules.append(f"REASONING: {TEXT}")
    structured = StructuredOutput(lark="\n".join(r for r in rules if r))
    _check(structured, "tools" if enforce_calls else "response_format")
    return structured


def _think_prefix(prompt: str) -> str:
    """The grammar's reasoning part: required when the prompt opened it, optional when the reply may open it."""
    tail = prompt.rstrip()
    if tail.endswith(THINK_END):
        return ""
    if tail.endswith(THINK_START):
        return f"REASONING? {THINK_END} "
    return f"({THINK_START} REASONING? {THINK_END})? "


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A 400 naming what in the schema cannot be enforced (unsupported keywords, bad regexes, wrong types)."""
    _check(StructuredOutput(json_schema=schema), param)


def _check(structured: StructuredOutput, param: str) -> None:
    try:
        structured.validate()
    except StructuredOutputError as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from None
