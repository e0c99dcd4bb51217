"""Incremental detokenization that never emits half a UTF-8 character."""

from engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level BPE splits multi-byte characters across tokens; decoding a token alone then yields
    U+FFFD. We decode a short window ending at the newest token and emit only once the window's text
    no longer ends in a partial character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # a little context so word-initial spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly decodable text (maybe empty)."""
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return self._emit(full[len(prefix) :])
        return ""

    def flush(self) -> str:
        """At the end of the output: what is still held back (a character left partial decodes as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        return self._emit(decode(self.ids[self.prefix_offset :])[len(prefix) :])

    def _emit(self, delta: str) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
