"""Splits generated text into DeepSeek's `<think>...</think>` reasoning and the answer, chunk by chunk."""

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """Incremental splitter: `feed()` each text delta, then `finish()`; each returns (reasoning, content).

    DeepSeek's chat templates end the prompt with `<think>` (thinking on: the output starts inside the
    reasoning) or `</think>` (thinking off). Without either, a reply that opens with `<think>` is
    reasoning up to `</think>`. Text that may be the start of a tag is held back until it is decided.
    """

    def __init__(self, in_reasoning: bool) -> None:
        self._state = "reasoning" if in_reasoning else "start"
        self._held = ""
        self.saw_reasoning = in_reasoning

    @classmethod
    def for_prompt(cls, prompt: str) -> "ReasoningParser | None":
        """The parser a rendered chat prompt calls for; None when thinking was switched off."""
        tail = prompt.rstrip()
        if tail.endswith(THINK_END):
            return None
        return cls(in_reasoning=tail.endswith(THINK_START))

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self._state, self.saw_reasoning = "reasoning", True
                text = stripped[len(THINK_START) :]
            elif THINK_START.startswith(stripped):  # "", "<", "<th", ... : not decided yet
                self._held = text
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                keep = partial_suffix(text, THINK_END)
                self._held = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            self._state = "after_reasoning"
            reasoning, text = text[:end], text[end + len(THINK_END) :]
            return reasoning, self._content(text)
        return "", self._content(text)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held if self._state != "after_reasoning" else held.lstrip()

    def _content(self, text: str) -> str:
        if self._state == "after_reasoning":
            # The answer after `</think>` starts at its first visible character.
            text = text.lstrip()
            if text:
                self._state = "content"
        return text


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
