"""The bookkeeping around a speculative step's forwards in single launches. In a fused step
(`SpecGraphs`) of one sequence on an H200 each PyTorch kernel of a few bytes costs ~1-2.5 us, and this
bookkeeping was ~40 of them (four row-metadata derivations, acceptance, the next rows, the output
buffer), a tenth of a step whose forwards are ~190 kernels.

- `decode_rows`: a one-token decode row's cache slot and context length from its position and block
  table (`model_runner.decode_rows_metadata`, every decode graph and MTP draft step).
- `accept`: per sequence of k + 1 rows (its last token, then its k drafts), the drafts accepted (the
  leading ones equal to the token drawn at the row before each) and the row its MTP drafts start from.
- `advance`: the next step's rows (the bonus token drawn at the last accepted row, then the new drafts)
  and their offsets into the decode graphs' buffers, live rows moved past the accepted tokens and their
  own (padding rows, on the scratch block, stay), and the same rows into the step's output buffer.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._util import check, pow2


@triton.jit
def _decode_rows_kernel(Pos, Tables, Slots, Lens, rows, stride_t, width, block_size, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = r < rows
    p = tl.load(Pos + r, mask=live, other=0)
    page = tl.load(Tables + r * stride_t + tl.minimum(p // block_size, width - 1), mask=live, other=0)
    tl.store(Slots + r, page.to(tl.int64) * block_size + p % block_size, mask=live)
    tl.store(Lens + r, (p + 1).to(tl.int32), mask=live)


def decode_rows(positions: torch.Tensor, tables: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [R] int64, tables [R, width] int32 -> (cache slots [R] int64, context lengths [R] int32).
    A position past the table's width reads its last column (padding rows)."""
    check(positions.dtype == torch.int64 and positions.dim() == 1, "positions must be int64 [R]")
    check(tables.dim() == 2 and tables.shape[0] == positions.shape[0] and tables.stride(1) == 1,
          "tables must be [R, width], contiguous in width")
    rows = positions.shape[0]
    slots = torch.empty(rows, dtype=torch.int64, device=positions.device)
    lens = torch.empty(rows, dtype=torch.int32, device=positions.device)
    if rows:
        block = min(pow2(rows), 1024)
        _decode_rows_kernel[(triton.cdiv(rows, block),)](positions, tables, slots, lens, rows, tables.stride(0),
                                                          tables.shape[1], block_size, BLOCK=block)
    return slots, lens


def reference_decode_rows(positions: torch.Tensor, tables: torch.Tensor, block_size: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    page = tables.gather(1, (positions // block_size).clamp(max=tables.shape[1] - 1)[:, None])[:, 0]
    return page.long() * block_size + positions % block_size, (positions + 1).int()


@triton.jit
def _accept_kernel(Tokens, Ids, Counts, Last, num_seqs, K: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    j = tl.arange(0, BLOCK_K)
    first = s * (K + 1)
    in_k = (s[:, None] < num_seqs) & (j[None, :] < K)
    drawn = tl.load(Tokens + first[:, None] + j[None, :], mask=in_k, other=0)
    draft = tl.load(Ids + first[:, None] + j[None, :] + 1, mask=in_k, other=0)
    # the first draft that differs from the draw before it (or k: all accepted)
    count = tl.min(tl.where(in_k & (drawn == draft), K, j[None, :]), axis=1)
    live = s < num_seqs
    tl.store(Counts + s, count.to(tl.int64), mask=live)
    tl.store(Last + s, (first + count).to(tl.int64), mask=live)


def accept(tokens: torch.Tensor, ids: torch.Tensor, k: int, counts: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [S * (k + 1)] the draws at each row, ids [S * (k + 1)] each row's input (a sequence's last
    token, then its drafts) -> (accepted drafts [S] int64, written into `counts` if given; each
    sequence's last accepted row [S] int64)."""
    check(tokens.shape == ids.shape and tokens.dim() == 1 and tokens.shape[0] % (k + 1) == 0,
          "tokens and ids must be [S * (k + 1)]")
    num_seqs = tokens.shape[0] // (k + 1)
    if counts is None:
        counts = torch.empty(num_seqs, dtype=torch.int64, device=tokens.device)
    last = torch.empty(num_seqs, dtype=torch.int64, device=tokens.device)
    if num_seqs:
        block = min(pow2(num_seqs, 1), 64)
        _accept_kernel[(triton.cdiv(num_seqs, block),)](tokens, ids, counts, last, num_seqs, K=k, BLOCK_S=block,
                                                         BLOCK_K=pow2(k, 2))
    return counts, last


def reference_accept(tokens: torch.Tensor, ids: torch.Tensor, k: int, counts: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    drawn, rows = tokens.view(-1, k + 1), ids.view(-1, k + 1)
    accepted = (drawn[:, :k] == rows[:, 1:]).long().cumprod(dim=1).sum(dim=1)
    counts = accepted if counts is None else counts.copy_(accepted)
    return counts, torch.arange(0, tokens.shape[0], k + 1, device=tokens.device) + counts


@triton.jit
def _advance_kernel(Tokens, Counts, Drafts, Tables, Ids, Pos, Following, Offsets, num_seqs, stride_t, scratch,
                    K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    j = tl.arange(0, BLOCK_R)
    live_s = s < num_seqs
    count = tl.load(Counts + s, mask=live_s, other=0)
    bonus = tl.load(Tokens + s * (K + 1) + count, mask=live_s, other=0)
    m = live_s[:, None] & (j[None, :] < K + 1)
    drafts = tl.load(Drafts + s[:, None] * K + j[None, :] - 1, mask=m & (j[None, :] > 0), other=0)
    following = tl.where(j[None, :] == 0, bonus[:, None], drafts)
    row = s[:, None] * (K + 1) + j[None, :]
    tl.store(Ids + row, following, mask=m)
    tl.store(Following + row, following, mask=m)
    offset = tl.broadcast_to(count[:, None], (BLOCK_S, BLOCK_R))
    tl.store(Offsets + row, offset, mask=m)
    # a padding row's table is the scratch block's: it stays at position 0
    moves = tl.load(Tables + row * stride_t, mask=m, other=scratch) != scratch
    pos = tl.load(Pos + row, mask=m, other=0)
    tl.store(Pos + row, pos + tl.where(moves, offset + 1, 0), mask=m)


def advance(tokens: torch.Tensor, counts: torch.Tensor, drafts: torch.Tensor, tables: torch.Tensor, scratch: int,
            ids: torch.Tensor, positions: torch.Tensor, following: torch.Tensor, offsets: torch.Tensor) -> None:
    """tokens [S * (k + 1)] the draws, counts [S] accepted drafts, drafts [S, k] the new ones, tables
    [S * (k + 1), width] the rows' block tables (scratch: the padding rows' block) -> in place: ids and
    following [S * (k + 1)] each sequence's bonus token then drafts, offsets [S * (k + 1)] its count,
    positions [S * (k + 1)] += count + 1 on live rows."""
    num_seqs, k = drafts.shape
    n = num_seqs * (k + 1)
    check(tokens.shape == (n,) and counts.shape == (num_seqs,) and drafts.is_contiguous(), "shapes of a step")
    check(all(t.shape[0] >= n and t.stride(0) == 1 for t in (ids, positions, following, offsets)),
          "outputs must hold S * (k + 1) contiguous rows")
    if num_seqs:
        block = min(pow2(num_seqs, 1), 64)
        _advance_kernel[(triton.cdiv(num_seqs, block),)](tokens, counts, drafts, tables, ids, positions, following,
                                                          offsets, num_seqs, tables.stride(0), scratch, K=k,
                                                          BLOCK_S=block, BLOCK_R=pow2(k + 1, 2))


def reference_advance(tokens: torch.Tensor, counts: torch.Tensor, drafts: torch.Tensor, tables: torch.Tensor,
                      scratch: int, ids: torch.Tensor, positions: torch.Tensor, following: torch.Tensor,
                      offsets: torch.Tensor) -> None:
    num_seqs, k = drafts.shape
    n = num_seqs * (k + 1)
    rows = torch.cat([tokens.view(num_seqs, k + 1).gather(1, counts[:, None]), drafts], dim=1).flatten()
    shift = counts[:, None].expand(num_seqs, k + 1).flatten()
    ids[:n].copy_(rows)
    following[:n].copy_(rows)
    offsets[:n].copy_(shift)
    positions[:n].add_((shift + 1) * (tables[:n, 0] != scratch))
