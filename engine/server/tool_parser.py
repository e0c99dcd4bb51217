"""Splits generated text into the answer and DeepSeek tool calls, chunk by chunk (streamed deltas) or whole."""

import uuid
from dataclasses import dataclass

from engine.server.reasoning import partial_suffix
from engine.server.tool_format import CALLS_BEGIN, CALLS_END, ToolFormat


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallDelta:
    """What a text delta added to call `index`: its id and name the first time, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCallParser:
    """Incremental: `feed()` each text delta, then `finish()`; each returns (content, tool-call deltas).

    Text before CALLS_BEGIN is content; after it come calls, and whatever follows CALLS_END is dropped. A marker
    may arrive split over any number of deltas: text that may be the start of the next one is held back until
    it is decided. `max_calls` (1 when parallel_tool_calls is false) ends the calls after that many.
    """

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._state = "content"  # content | between | name | arguments | done
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        text, self._held = self._held + text, ""
        content, deltas = "", []
        while text:
            if self._state == "content":
                at = text.find(CALLS_BEGIN)
                if at < 0:
                    keep = partial_suffix(text, CALLS_BEGIN)
                    content += text[: len(text) - keep]
                    self._held = text[len(text) - keep :]
                    break
                content += text[:at]
                text, self._state = text[at + len(CALLS_BEGIN) :], "between"
            elif self._state == "between":
                text = text.lstrip()  # V3 puts a newline between calls
                if text.startswith(self.fmt.head):
                    text, self._state = text[len(self.fmt.head) :], "name"
                elif text.startswith(CALLS_END) or not (self.fmt.head.startswith(text) or CALLS_END.startswith(text)):
                    self._state = "done"  # the end, or not a call: nothing after it is parsed
                else:
                    self._held = text  # the start of a marker
                    break
            elif self._state == "name":
                at = text.find(self.fmt.name_end)
                if at < 0:
                    self._held = text
                    break
                call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=text[:at].strip())
                self.calls.append(call)
                deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, call.name))
                text, self._state = text[at + len(self.fmt.name_end) :], "arguments"
            elif self._state == "arguments":
                at = text.find(self.fmt.args_end)
                keep = partial_suffix(text, self.fmt.args_end) if at < 0 else 0
                piece = text[: len(text) - keep] if at < 0 else text[:at]
                self._add_arguments(piece, deltas)
                if at < 0:
                    self._held = text[len(text) - keep :]
                    break
                text = text[at + len(self.fmt.args_end) :]
                self._state = "done" if self.max_calls is not None and len(self.calls) >= self.max_calls else "between"
            else:  # done
                break
        return content, _merged(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: held-back text is content, or the tail of unfinished arguments."""
        held, self._held = self._held, ""
        if self._state == "content":
            return held, []
        deltas: list[ToolCallDelta] = []
        if self._state == "arguments":
            self._add_arguments(held, deltas)
        return "", _merged(deltas)

    def _add_arguments(self, piece: str, deltas: list[ToolCallDelta]) -> None:
        if piece:
            self.calls[-1].arguments += piece
            deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One delta per call: a call's name and its first argument text in one chunk."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out
