"""After a step: each sampled token into its request's text, stops, logprobs and `RequestOutput`.

Request and streaming state (detokenizer, text, logprobs, what was already emitted) lives here, keyed
by request id; a `Sequence` holds scheduling state only. Nothing here touches the device: with async
scheduling this runs while the next step computes.
"""

from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer


@dataclass
class RequestState:
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    text: str = ""  # generated text, stop string trimmed
    num_emitted_tokens: int = 0  # what the last RequestOutput already carried
    num_emitted_chars: int = 0
    stop_hold: int = 0  # characters held back while streaming: they may start a stop string


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.states: dict[str, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        p = seq.params
        self.states[seq.request_id] = RequestState(
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids), [] if p.logprobs is not None else None,
            stop_hold=max((len(s) for s in p.stop), default=1) - 1)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, max_model_len: int) -> str | None:
        """Add a sampled token to the sequence and its request -> why it finishes now ("stop",
        "length"), or None."""
        p, state = seq.params, self.states[seq.request_id]
        seq.output_token_ids.append(token)
        if state.logprobs is not None:
            state.logprobs.append(logprobs)
        num_out = len(seq.output_token_ids)
        if num_out > p.min_tokens and ((not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids):
            state.text += state.detokenizer.flush()  # the stop token itself is not text
            return "stop"
        delta = state.detokenizer.add(token)
        if delta:
            state.text += delta
            if p.stop and num_out > p.min_tokens and self._trim_at_stop_string(state, p, len(delta)):
                return "stop"
        if (p.max_tokens is not None and num_out >= p.max_tokens) or seq.num_tokens >= max_model_len:
            state.text += state.detokenizer.flush()
            return "length"
        return None

    @staticmethod
    def _trim_at_stop_string(state: RequestState, p, delta_len: int) -> bool:
        for stop in p.stop:
            # a stop string can straddle the new text and what came before
            start = max(0, len(state.text) - delta_len - len(stop) + 1)
            idx = state.text.find(stop, start)
            if idx != -1:
                state.text = state.text[: idx + len(stop) if p.include_stop_str_in_output else idx]
                return True
        return False

    def output(self, seq: Sequence) -> RequestOutput:
        state = self.states[seq.request_id]
        # hold back what could still turn out to be the start of a stop string
        hold = 0 if seq.is_finished or not seq.params.stop else state.stop_hold
        visible = state.text[: max(state.num_emitted_chars, len(state.text) - hold)]
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=visible,
            logprobs=state.logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_remote_cached_tokens=max(0, min(seq.num_cached_tokens, seq.remote_span[1]) - seq.remote_span[0]),
            new_token_ids=seq.output_token_ids[state.num_emitted_tokens :],
            new_text=visible[state.num_emitted_chars :],
            metrics=seq.metrics,
        )
        state.num_emitted_tokens, state.num_emitted_chars = len(seq.output_token_ids), len(visible)
        if seq.is_finished:
            self.remove(seq.request_id)
        return out
