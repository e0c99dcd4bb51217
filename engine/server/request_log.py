"""The one log line per finished request: the figures published benchmarks of DeepSeek engines quote."""

from engine.outputs import RequestOutput


def summarize(out: RequestOutput) -> str:
    """`request X finished (stop): prompt_tokens=.. cached_tokens=.. ttft=..s prefill=.. tok/s decode=.. tok/s`"""
    num_prompt, num_generated = len(out.prompt_token_ids), len(out.token_ids)
    line = (
        f"request {out.request_id} finished ({out.finish_reason}): prompt_tokens={num_prompt} "
        f"cached_tokens={out.num_cached_tokens} generated_tokens={num_generated}"
    )
    m = out.metrics
    if m is None or m.first_token_time is None:
        return line
    ttft = m.first_token_time - m.arrival_time
    prefill_start = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
    prefill_s = m.first_token_time - prefill_start
    line += f" ttft={ttft:.3f}s prefill={_rate(m.num_prefill_tokens, prefill_s)} tok/s"
    if m.finished_time is not None and num_generated > 1:
        # The first token comes out of the prefill; decode speed counts the tokens after it.
        line += f" decode={_rate(num_generated - 1, m.finished_time - m.first_token_time)} tok/s"
    if m.num_verify_steps:
        # speculative decoding: drafts accepted of those verified, and tokens gained per verification
        line += (f" spec_accepted={m.num_accepted_tokens}/{m.num_draft_tokens}"
                 f" accepted_len={(m.num_accepted_tokens + m.num_verify_steps) / m.num_verify_steps:.2f}")
    return line


def _rate(num_tokens: int, seconds: float) -> str:
    return f"{num_tokens / seconds:.1f}" if seconds > 0 else "inf"
