"""DeepSeek-V4 attention over the paged caches (reference PyTorch backend).

Each layer attends to a sliding window of raw tokens (the `window` cache: one row per token, the
shared K=V head after its norm and RoPE) and, in compressed layers, to entries that pool windows of
`m` tokens (the `compressed` cache, one row per m tokens). CSA layers (m = 4) pool overlapping
windows (entry w mixes series A of window w-1 with series B of window w) and read a top-k of their
entries chosen by the lightning indexer (its keys are the `indexer_keys` cache, pooled the same way);
HCA layers (m = 128) read every entry. Entries exist for closed windows only: query t sees entry w
iff w < (t + 1) // m.

The pooling is a softmax over a window's slots per channel, so it is kept as an online-softmax
accumulator (running max, sum of exponentials, weighted sum: [3, d]) that a chunk of tokens extends.
The accumulators open at a block's end (or at the last token written, for the block being filled)
are the block's `compressor_state` row: a prefix that ends inside a window carries its open state
with its blocks (prefix cache, preemption, KV transfer), and a chunk that starts there resumes it.
Block size is a multiple of every ratio, so a block's end is always a window boundary.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def empty_acc(d: int, device: torch.device) -> torch.Tensor:
    """An accumulator over no slots: [3, d] = (max -inf, sum 0, weighted sum 0)."""
    acc = torch.zeros(3, d, dtype=torch.float32, device=device)
    acc[0] = NEG_INF
    return acc


def pool(g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Softmax pooling of slots: g (gate logits), c (values) [n, slots, d] -> accumulators [n, 3, d]."""
    m = g.amax(1)
    p = torch.exp(g - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[:, None])  # empty slots: exp(-inf) = 0
    return torch.stack([m, p.sum(1), (p * c).sum(1)], 1)


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two accumulators [..., 3, d] over disjoint slots -> one over both."""
    m = torch.maximum(a[..., 0, :], b[..., 0, :])
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(a[..., 0, :] - safe), torch.exp(b[..., 0, :] - safe)
    return torch.stack([m, a[..., 1, :] * wa + b[..., 1, :] * wb, a[..., 2, :] * wa + b[..., 2, :] * wb], -2)


def pooled(acc: torch.Tensor) -> torch.Tensor:
    """[..., 3, d] -> the softmax-weighted sum [..., d]."""
    return acc[..., 2, :] / acc[..., 1, :]


@dataclass
class Row:
    """One sequence of the step: its tokens [start, end) in the batch, cache length after the step,
    its block-table row (device)."""

    start: int
    end: int
    context_len: int
    table: torch.Tensor

    @property
    def num_new(self) -> int:
        return self.end - self.start

    @property
    def num_cached(self) -> int:
        return self.context_len - self.num_new


def rows_of(meta) -> list[Row]:
    """The step's rows, built once per step and shared by the layers."""
    rows = getattr(meta, "_v4_rows", None)
    if rows is None:
        tables = meta.block_tables.long()
        qs = meta.query_start_loc_cpu
        rows = [Row(qs[i], qs[i + 1], meta.context_lens_cpu[i], tables[i]) for i in range(len(meta.context_lens_cpu))]
        meta._v4_rows = rows
    return rows


def entry_slots(table: torch.Tensor, first: int, count: int, ratio: int, block_size: int) -> torch.Tensor:
    """One row's table: flat rows of entries [first, first + count) of a cache compressed `ratio` times."""
    w = torch.arange(first, first + count, device=table.device)
    return table_entry_slots(table[None], w[None], ratio, block_size)[0]


def token_slots(table: torch.Tensor, first: int, end: int, block_size: int) -> torch.Tensor:
    """One row's table: flat rows of tokens [first, end)."""
    return table_slots(table[None], torch.arange(first, end, device=table.device)[None], block_size)[0]


class WindowPooler:
    """Pools one chunk of a row's tokens into compressed entries (the compressors' reference path).

    c, g: [q, width] values and gate logits (position bias added) of the row's new tokens; width is
    2d with overlap (series A = [:d], B = [d:]) else d. The state holds `cur` (the entry of the open
    window so far) and, with overlap, `nxt` (series A of the open window: the next entry's first half).
    """

    def __init__(self, d: int, ratio: int, overlap: bool):
        self.d, self.ratio, self.overlap = d, ratio, overlap

    @property
    def state_width(self) -> int:
        return 3 * self.d * (2 if self.overlap else 1)

    def run(self, c: torch.Tensor, g: torch.Tensor, n: int, state: torch.Tensor | None,
            block_size: int) -> tuple[torch.Tensor, int, list[tuple[int, torch.Tensor]]]:
        """-> (accumulators of the entries this chunk closes [k, 3, d], the first one's index,
        [(block index, its state row [state_width])] for every block the chunk reaches)."""
        d, m = self.d, self.ratio
        q, dev = c.shape[0], c.device
        end = n + q
        w0, nw = n // m, (end - 1) // m - n // m + 1
        width = c.shape[1]
        gg = torch.full((nw * m, width), NEG_INF, dtype=torch.float32, device=dev)
        cc = torch.zeros(nw * m, width, dtype=torch.float32, device=dev)
        gg[n - w0 * m: end - w0 * m] = g
        cc[n - w0 * m: end - w0 * m] = c
        gg, cc = gg.view(nw, m, width), cc.view(nw, m, width)
        empty = empty_acc(d, dev)
        if state is None:
            cur_in, nxt_in = empty, empty
        else:
            cur_in = state[: 3 * d].view(3, d)
            nxt_in = state[3 * d:].view(3, d) if self.overlap else empty
        if self.overlap:
            a, b = pool(gg[..., :d], cc[..., :d]), pool(gg[..., d:], cc[..., d:])
            a_total = torch.cat([merge(nxt_in, a[0])[None], a[1:]])
            entry = torch.cat([merge(cur_in, b[0])[None], merge(a_total[:-1], b[1:])])
        else:
            b = pool(gg, cc)
            a_total = None
            entry = torch.cat([merge(cur_in, b[0])[None], b[1:]])

        def state_at(p: int) -> torch.Tensor:
            if p % m == 0:  # a window boundary: nothing of window p // m yet
                cur = a_total[p // m - 1 - w0] if self.overlap else empty
                parts = [cur, empty] if self.overlap else [cur]
            else:
                i = p // m - w0
                parts = [entry[i], a_total[i]] if self.overlap else [entry[i]]
            return torch.cat([x.flatten() for x in parts])

        states = [(blk, state_at(min((blk + 1) * block_size, end)))
                  for blk in range(n // block_size, (end - 1) // block_size + 1)]
        closed = end // m - w0
        return entry[:closed], w0, states


def attend(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
           scale: float) -> torch.Tensor:
    """q [t, H, D], keys (K = V) [k, D] shared by every query or [t, k, D] a query each, allowed [t, k]
    bool, sinks [H] -> [t, H, D].

    The sink is one more logit per head in the softmax's denominator, with no value."""
    k = "kd" if keys.dim() == 2 else "tkd"
    logits = torch.einsum(f"thd,{k}->thk", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~allowed[:, None, :], NEG_INF)
    sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum(f"thk,{k}->thd", probs, keys.float()).to(q.dtype)


def window_mask(t: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    diff = t[:, None] - key_pos[None, :]
    return (diff >= 0) & (diff < window)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The lightning indexer's scores: q [t, h, c], weights [t, h], keys [n, c] shared or [t, n, c] a
    query each -> [t, n] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * scale."""
    k = "nc" if keys.dim() == 2 else "tnc"
    return (F.relu(torch.einsum(f"thc,{k}->thn", q.float(), keys.float())) * scale * weights.float()[..., None]).sum(1)


def indexer_picks(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, top_k: int,
                  scale: float) -> torch.Tensor:
    """visible [t, n] -> the entries [t, min(top_k, n)] of the highest visible `indexer_scores` (picks
    of invisible entries are the caller's to mask)."""
    scores = indexer_scores(q, weights, keys, scale)
    return scores.masked_fill(~visible, NEG_INF).topk(min(top_k, keys.shape[-2]), dim=-1).indices


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, top_k: int,
                 scale: float) -> torch.Tensor:
    """`indexer_picks` as a mask [t, n] of the visible entries picked."""
    picks = indexer_picks(q, weights, keys, visible, top_k, scale)
    return torch.zeros_like(visible).scatter_(1, picks, True) & visible


# -- decode steps without host lists (one token per row, each row its own sequence) ------------------
# Every shape is fixed by the batch and max_model_len, nothing is read back to the host: a CUDA graph
# captures the step. Entries are gathered up to the most a sequence of max_model_len tokens has
# (max_entries) and masked, so the work follows max_model_len, not each sequence's length.


def empty_state(width: int, d: int, device: torch.device) -> torch.Tensor:
    """A flat state row of empty accumulators: per [3, d] block max -inf, sums 0."""
    row = torch.zeros(width, dtype=torch.float32, device=device).view(-1, 3, d)
    row[:, 0] = NEG_INF
    return row.flatten()


def _one_slot(g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The accumulator of a single slot: [B, 3, d] = (g, 1, c)."""
    return torch.stack([g, torch.ones_like(g), c], 1)


def decode_pool(pooler: WindowPooler, c: torch.Tensor, g: torch.Tensor, t: torch.Tensor, held: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row into its open window: c, g [B, width], t [B] positions, held [B, state_width]
    (the state before t) -> (the open entry's accumulator [B, 3, d], whether t closes its window [B],
    the state after t [B, state_width]), as WindowPooler.run computes them for one token."""
    d, m = pooler.d, pooler.ratio
    b = c.shape[0]
    cur_in = held[:, : 3 * d].view(b, 3, d)
    closing = (t + 1) % m == 0
    empty = empty_state(3 * d, d, c.device).view(1, 3, d).expand(b, 3, d)
    if pooler.overlap:
        nxt_in = held[:, 3 * d:].view(b, 3, d)
        cur = merge(cur_in, _one_slot(g[:, d:], c[:, d:]))
        a_total = merge(nxt_in, _one_slot(g[:, :d], c[:, :d]))
        after = torch.where(closing[:, None, None, None], torch.stack([a_total, empty], 1), torch.stack([cur, a_total], 1))
    else:
        cur = merge(cur_in, _one_slot(g, c))
        after = torch.where(closing[:, None, None], empty, cur)[:, None]
    return cur, closing, after.flatten(1)


def table_slots(tables: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """tables [B, width] (int64), pos [B, n] raw-token positions -> flat token rows [B, n]."""
    blk = tables.gather(1, (pos // block_size).clamp(max=tables.shape[1] - 1))
    return blk * block_size + pos % block_size


def table_entry_slots(tables: torch.Tensor, w: torch.Tensor, ratio: int, block_size: int) -> torch.Tensor:
    """tables [B, width], w [B, n] entry indices -> flat rows [B, n] of a cache compressed `ratio` times."""
    per_block = block_size // ratio
    blk = tables.gather(1, (w * ratio // block_size).clamp(max=tables.shape[1] - 1))
    return blk * per_block + w % per_block
