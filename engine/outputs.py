"""What the engine hands back for a request."""

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() at add_request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prefill_tokens: int = 0  # prompt tokens actually computed (prompt minus cached)
    # speculative decoding: draft tokens verified, those accepted, and the steps that verified them
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0


@dataclass
class RequestOutput:
    """A request's state after a step: cumulative fields plus the delta since the last output."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # detokenized generated text so far (stop string trimmed)
    logprobs: list[dict[int, float]] | None  # one dict per generated token: chosen + top-k
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int  # prompt tokens served from the prefix cache (local or pulled from a peer)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    metrics: RequestMetrics | None = None
    num_remote_cached_tokens: int = 0  # of num_cached_tokens, those pulled from another replica
