"""DeepSeek's tool-call formats: which one a model's chat template writes, the tools' part of the system
prompt, and the Lark grammar (llguidance's dialect) of the calls.

Both formats wrap the calls in special tokens, `<｜tool▁calls▁begin｜> call... <｜tool▁calls▁end｜>`:

    V3.1  <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>      calls chained directly
    V3    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>   one per line

ARGUMENTS is the JSON object the tool's `parameters` schema describes (OpenAI sends it as a string).
"""

import json
from dataclasses import dataclass
from typing import Any

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

# What a function without `parameters` takes, as OpenAI defines it: an empty parameter list.
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFormat:
    """One format: CALLS_BEGIN, then per call `head NAME name_end ARGUMENTS args_end` joined by `call_sep`,
    then CALLS_END."""

    name: str
    head: str
    name_end: str
    args_end: str
    call_sep: str
    chaining: str  # how the tools prompt says to write several calls

    def call(self, name: str, arguments: str) -> str:
        return f"{self.head}{name}{self.name_end}{arguments}{self.args_end}"

    def calls(self, calls: list[tuple[str, str]]) -> str:
        return CALLS_BEGIN + self.call_sep.join(self.call(n, a) for n, a in calls) + CALLS_END

    def tools_prompt(self, tools: list[dict]) -> str:
        """The tools' part of the system prompt, laid out as DeepSeek-V3.1's model card gives it."""
        lines = ["## Tools", "You have access to the following tools:"]
        for tool in tools:
            fn = tool["function"]
            parameters = fn.get("parameters") or NO_PARAMETERS
            lines += ["", f"### {fn['name']}", f"Description: {fn.get('description') or ''}", "",
                      f"Parameters: {json.dumps(parameters, ensure_ascii=False)}"]
        example = (CALLS_BEGIN + self.call("tool_call_name", "tool_call_arguments") + "{{additional_tool_calls}}"
                   + CALLS_END)
        lines += [
            "", "IMPORTANT: ALWAYS adhere to this exact format for tool use:", example, "", "Where:", "",
            "- `tool_call_name` must be an exact match to one of the available tools",
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema",
            f"- For multiple tool calls, {self.chaining}",
        ]
        return "\n".join(lines) + "\n"

    def lark_calls(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """Lark rules defining `calls`: one call (several if `parallel`) of one of `functions` (name, parameters
        schema), each with arguments that match its schema."""
        if not parallel:
            body = "call"
        elif self.call_sep:
            body = f"call ({lark_text(self.call_sep)} call)*"
        else:
            body = "call+"
        rules = [f"calls: {lark_text(CALLS_BEGIN)} {body} {lark_text(CALLS_END)}",
                 "call: " + " | ".join(f"fn_{i}" for i in range(len(functions)))]
        for i, (name, schema) in enumerate(functions):
            rules.append(f"fn_{i}: {lark_text(self.head)} {json.dumps(name)} {lark_text(self.name_end)} "
                         f"{lark_json(schema)} {lark_text(self.args_end)}")
        return "\n".join(rules)


V31 = ToolFormat("deepseek_v31", CALL_BEGIN, SEP, CALL_END, "",
                 "chain them directly without separators or spaces")
V3 = ToolFormat("deepseek_v3", CALL_BEGIN + "function" + SEP, "\n```json\n", "\n```" + CALL_END, "\n",
                "put each one on a new line")
FORMATS = (V31, V3)


def detect(tokenizer: Any) -> ToolFormat | None:
    """The format the model's chat template writes an assistant's tool call in; None if it writes none this
    server can parse (or the tokenizer lacks the markers as single tokens that survive decoding)."""
    name, arguments = "probe_fn", '{"x": 1}'
    probe = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}]},
    ]
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that cannot render a tool call has no tool format
        return None
    for fmt in FORMATS:
        if fmt.call(name, arguments) in text and all(_is_one_token(tokenizer, m) for m in MARKERS):
            return fmt
    return None


def _is_one_token(tokenizer: Any, text: str) -> bool:
    ids = tokenizer.encode(text, add_bos=False)
    return len(ids) == 1 and tokenizer.decode(ids) == text


def lark_text(text: str) -> str:
    """A fixed string as a Lark expression: the markers as special tokens (`<｜tool▁sep｜>`: llguidance lets no
    text lexeme take a special token), the rest as string literals."""
    parts, rest = [], text
    while rest:
        found = min(((rest.find(m), m) for m in MARKERS if m in rest), default=None)
        if found is None:
            parts.append(json.dumps(rest, ensure_ascii=False))
            break
        at, marker = found
        if at:
            parts.append(json.dumps(rest[:at], ensure_ascii=False))
        parts.append(marker)
        rest = rest[at + len(marker) :]
    return " ".join(parts)


def lark_json(schema: dict[str, Any]) -> str:
    """An embedded JSON schema, written compactly (no whitespace between tokens: an unbounded run of
    spaces is a way for a sampled output never to end)."""
    return "%json" + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)
