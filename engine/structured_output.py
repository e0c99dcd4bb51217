"""Grammar-constrained decoding: a request's output forced to match a JSON schema, any JSON object, or a
Lark grammar, by masking the tokens that cannot continue it at each step.

llguidance does the matching (its Rust parser computes a step's mask over the whole vocabulary in
tens of microseconds, lazily over the grammar's lexemes, and covers JSON Schema broadly while
naming what it cannot enforce); xgrammar precompiles masks per grammar state, faster per step for a
fixed grammar but slower to compile each new schema, which agents send per request. The mask is a
bitmask per row ([rows, ceil(vocab / 32)] int32) applied to the logits on their device before
sampling; the matcher lives on the host beside the request and consumes each sampled token. The masks
are computed after the step's forward pass is queued, so on a GPU they overlap it; a guided row's
next step waits for its token (its mask needs it), so async scheduling pauses while one runs.
"""

from dataclasses import dataclass
from typing import Any


class StructuredOutputError(ValueError):
    """A schema or grammar that cannot be enforced: what is wrong or unsupported, for a 400."""


@dataclass(frozen=True)
class StructuredOutput:
    """What an output must match: exactly one of a JSON schema, any JSON object, or a Lark grammar
    (llguidance's dialect: `%json{...}` embeds a JSON schema, special tokens are written `<|...|>` or
    by their text)."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    lark: str | None = None

    def __post_init__(self) -> None:
        given = (self.json_schema is not None) + bool(self.json_object) + (self.lark is not None)
        if given != 1:
            raise StructuredOutputError("a structured output takes exactly one of json_schema, json_object, lark")

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form)."""
        from llguidance import LLMatcher

        if self.lark is not None:
            return LLMatcher.grammar_from_lark(self.lark)
        schema = self.json_schema if self.json_schema is not None else {"type": "object"}
        return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})

    def validate(self) -> None:
        """Raise StructuredOutputError naming what cannot be enforced (unsupported keywords, bad syntax)."""
        from llguidance import LLMatcher

        try:
            grammar = self.grammar()
        except (ValueError, TypeError) as e:
            raise StructuredOutputError(f"invalid {self._kind()}: {e}") from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise StructuredOutputError(f"cannot enforce this {self._kind()}: {'; '.join(messages)}")

    def _kind(self) -> str:
        return "JSON schema" if self.json_schema is not None else "json_object" if self.json_object else "grammar"


class Guide:
    """One request's matcher, on the host: the mask of what may come next, and each sampled token fed in."""

    def __init__(self, tokenizer, structured: StructuredOutput):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, structured.grammar())
        if self.matcher.is_error():
            raise StructuredOutputError(f"cannot enforce this {structured._kind()}: {self.matcher.get_error()}")

    def fill(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit t % 32 of word t // 32)."""
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def advance(self, token: int) -> bool:
        """Feed a sampled token; False if the grammar did not allow it."""
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The output is complete: nothing may follow (the grammar ended, or took the EOS token)."""
        return self.matcher.is_stopped()


def guide_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids):
    """The matchers' view of the tokenizer (tokenizer.json's text; built once per engine: ~1 s for a 129k
    vocabulary), sized to the model's vocabulary (its padding rows are never allowed)."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))


def fill_bitmask(guides: list, bitmask: "torch.Tensor") -> None:
    """bitmask[j] = what guides[j] allows next (host, int32 [rows, words]), row by row: llguidance's own
    threads were no faster up to 32 rows on 2 cores and slower on a 16-core H200 host, where the hand-offs
    cost more than the masks (docs/perf.md, "Structured outputs: what the masks cost")."""
    for j, g in enumerate(guides):
        g.fill(bitmask, j)


def apply_guides(logits: "torch.Tensor", guides: list) -> None:
    """Mask, in place, what each row's guide forbids; logits [R, V] on any device, guides [R] (None: no
    constraint). One [R', V / 32] int32 bitmask crosses to the device per step."""
    import torch

    from engine.copies import index_to_device

    rows = [i for i, g in enumerate(guides) if g is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    words = -(-vocab // 32)
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32, pin_memory=logits.is_cuda)
    fill_bitmask([guides[i] for i in rows], bitmask)
    mask = bitmask.to(logits.device, non_blocking=True)
    bits = (mask[:, :, None] >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
    allowed = bits.view(len(rows), words * 32)[:, :vocab].bool()
    # the guided rows' index through a pinned copy: a pageable one waits for the step in flight
    # (engine.copies), and only batches mixing guided and free rows need the index
    index = index_to_device(tuple(rows), logits.device) if len(rows) < logits.shape[0] else None
    if index is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
