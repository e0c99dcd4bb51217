"""Per-request sampling settings."""

from dataclasses import dataclass, field

from engine.structured_output import StructuredOutput


@dataclass
class SamplingParams:
    """How to sample one request's tokens; `validate()` raises ValueError naming the bad field."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs beside the chosen token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    # the output must match a JSON schema / any JSON object / a grammar (tokens it forbids are masked)
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def is_greedy(self) -> bool:
        # below 1e-5 dividing by the temperature overflows float32 logits: that is argmax anyway
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether the tokens before a position change its logits (presence / frequency penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty)

    def validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            bad("temperature", "must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", "must be -1 (disabled) or >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad("logprobs", "must be in [0, 20]")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", "must be in [-2, 2]")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", "must be in [-2, 2]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            bad("structured_output", "must be an engine.structured_output.StructuredOutput")
