"""Engram (DeepSeek-V4.1): n-gram lookup tables written into the residual streams, gated by how well
the looked-up value matches each stream.

Per position and Engram layer: the compressed ids (the tokenizer's map: tokens that normalize alike
share one) of the token and the `max_ngram_size - 1` before it; every look-back slot at or beyond the
nearest dead one (before the sequence start, an image token) takes the pad token's id. The ids times
per-look-back odd multipliers are XOR-folded one look-back at a time; after look-back j the running
value modulo each head's prime is that head's (j + 1)-gram bucket, plus the column's offset in the
layer's table. The rows of all (n-gram, head) columns [cols, head_dim] go through `wkv` to one key per
stream and a shared value; gate = sigmoid(signed sqrt of the normalized key . stream dot).

The ids depend on the tokens only, so the rows of a step can be gathered before the layer runs, and
the tables (98 GB each in V4.1 Flash) can live in (pinned) host memory: `EngramTable.place`; the
model hashes a step's tokens and gathers every Engram layer's rows before layer 0 (`EngramTable.fetch`:
into pinned memory, copied on a side stream that the layer waits on, `EngramRows.wait`).
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.layers.linear import Linear

DEAD = -1  # a look-back slot no n-gram reaches across


def compressed_token_map(tokenizer_file: str) -> tuple[list[int], int]:
    """token id -> compressed id from a `tokenizers` tokenizer.json: each token's own decode through
    NFKC, NFD, strip accents, lowercase, collapse whitespace, strip (a token that is one space stays
    one); tokens whose decode has U+FFFD (a partial UTF-8 byte) are keyed by their raw token string.
    Returns (the map, the number of compressed ids)."""
    from tokenizers import Regex, Tokenizer, normalizers

    keep_space = "\ue000"  # a private-use stand-in, so Strip() does not empty a lone space
    chain = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep_space),
        normalizers.Strip(), normalizers.Replace(keep_space, " "),
    ])
    tok = Tokenizer.from_file(tokenizer_file)
    ids: dict[str, int] = {}
    out = []
    for token in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token], skip_special_tokens=False)
        key = tok.id_to_token(token) if "\ufffd" in text else (chain.normalize_str(text) or text)
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def hash_primes(num_layers: int, max_ngram_size: int, num_heads: int, vocab_size: int) -> list[list[list[int]]]:
    """[layer][n-gram size - 2][head]: successive primes above vocab_size - 1, in that order, never reused."""
    out, p = [], vocab_size - 1
    for _ in range(num_layers):
        layer = []
        for _ in range(max_ngram_size - 1):
            heads = []
            for _ in range(num_heads):
                p += 1
                while not _is_prime(p):
                    p += 1
                heads.append(p)
            layer.append(heads)
        out.append(layer)
    return out


def hash_multipliers(layer_ids: list[int], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """[layers, max_ngram_size] odd int64 multipliers from numpy's default_rng(10007 * layer), bounded so
    id * multiplier cannot overflow."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.tensor(np.stack(rows))


class EngramHash(nn.Module):
    """Token ids -> each Engram layer's table rows: ids [T, L, cols] (cols = (max_ngram_size - 1) * heads)."""

    def __init__(self, layer_ids: list[int], max_ngram_size: int, num_heads: int, vocab_size: int,
                 compressed_vocab_size: int, pad_id: int):
        super().__init__()
        self.max_ngram_size, self.compressed_vocab_size, self.pad_token = max_ngram_size, compressed_vocab_size, pad_id
        primes = hash_primes(len(layer_ids), max_ngram_size, num_heads, vocab_size)
        offsets = []
        for layer in primes:
            flat = [p for heads in layer for p in heads]
            offsets.append([sum(flat[:i]) for i in range(len(flat))])
        self.register_buffer("primes", torch.tensor(primes), persistent=False)  # [L, n - 1, heads]
        self.register_buffer("offsets", torch.tensor(offsets), persistent=False)  # [L, cols]
        self.register_buffer("multipliers", hash_multipliers(layer_ids, max_ngram_size, compressed_vocab_size),
                             persistent=False)  # [L, n]
        self.register_buffer("token_map", torch.empty(0, dtype=torch.long), persistent=False)

    @property
    def context(self) -> int:
        """Look-back tokens a position needs before it."""
        return self.max_ngram_size - 1

    def bind(self, token_map: list[int], num_ids: int) -> None:
        if num_ids != self.compressed_vocab_size:
            raise ValueError(f"the tokenizer gives {num_ids} compressed ids for Engram, the config says "
                             f"engram_compressed_vocab_size {self.compressed_vocab_size}: every hash would differ")
        self.token_map = torch.tensor(token_map, dtype=torch.long, device=self.primes.device)

    def forward(self, ids: torch.Tensor, history: torch.Tensor, dead: torch.Tensor | None = None) -> torch.Tensor:
        """ids [T] token ids; history [T, context] the token ids before each (oldest first, DEAD where
        none); dead [T] bool (image tokens) or None -> table rows [T, L, cols] int64."""
        if self.token_map.numel() == 0:
            raise ValueError("Engram needs the tokenizer's compressed token map (bind it first)")
        seq = torch.cat([history, ids[:, None]], 1)  # [T, context + 1]
        if dead is not None:
            seq[:, -1] = seq[:, -1].masked_fill(dead, DEAD)
        compressed = torch.where(seq >= 0, self.token_map[seq.clamp(min=0)], DEAD)
        pad = self.token_map[self.pad_token]
        blocked = torch.zeros_like(ids, dtype=torch.bool)
        looks = []
        for shift in range(self.max_ngram_size):  # the token, then one step further back each time
            src = compressed[:, -1 - shift]
            blocked = blocked | (src == DEAD)
            looks.append(torch.where(blocked, pad, src))
        products = torch.stack(looks, -1)[:, None, :] * self.multipliers  # [T, L, n]
        rolling, buckets = products[..., 0], []
        for j in range(1, self.max_ngram_size):
            rolling = rolling ^ products[..., j]
            buckets.append(rolling[..., None] % self.primes[:, j - 1])  # [T, L, heads]
        return torch.cat(buckets, -1) + self.offsets


@dataclass
class EngramRows:
    """One Engram layer's rows for a step [T, cols, head_dim] on the compute device; `ready` is recorded on
    the side stream that copies them from host memory (None: already there)."""

    values: torch.Tensor
    ready: "torch.cuda.Event | None" = None

    def wait(self) -> torch.Tensor:
        """The rows, once the current stream has waited for their copy."""
        if self.ready is not None:
            stream = torch.cuda.current_stream(self.values.device)
            stream.wait_event(self.ready)
            self.values.record_stream(stream)  # allocated on the side stream, read on this one
            self.ready = None
        return self.values


_copy_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream that host-to-device copies of Engram rows run on, one per GPU."""
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device)
    return _copy_streams[device]


class EngramTable(nn.Module):
    """One layer's table [rows, head_dim]: on the model's device, or in host memory (pinned where a GPU
    is) with the rows a step needs gathered there and copied over."""

    def __init__(self, num_rows: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, head_dim), requires_grad=False)
        self.on_host = False

    def place(self, where: str) -> None:
        """"device" (as loaded) or "host"."""
        if where not in ("device", "host"):
            raise ValueError(f"Engram tables go on the 'device' or the 'host', not {where!r}")
        if where == "host" and not self.on_host:
            rows = self.weight.data.cpu()
            if torch.cuda.is_available():
                rows = rows.pin_memory()
            self.weight = nn.Parameter(rows, requires_grad=False)
            self.on_host = True

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [...] int64 on the table's device -> [..., head_dim] there."""
        return self.weight[rows]

    def fetch(self, rows: torch.Tensor, device: torch.device) -> EngramRows:
        """A host table's rows [...] (int64 on the host) gathered into pinned memory and copied to `device`
        on the side stream, without waiting for the copy: -> [..., head_dim] there once `wait`ed for."""
        head_dim = self.weight.shape[1]
        staged = torch.empty(rows.numel(), head_dim, dtype=self.weight.dtype, pin_memory=device.type == "cuda")
        torch.index_select(self.weight, 0, rows.flatten(), out=staged)
        staged = staged.view(*rows.shape, head_dim)
        if device.type != "cuda":
            return EngramRows(staged.to(device))
        stream = copy_stream(device)
        with torch.cuda.stream(stream):
            # allocated on the side stream, so the copy waits for nothing queued on the compute stream;
            # the pinned buffer goes back to the host allocator only once the copy is done
            values = staged.to(device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        return EngramRows(values, ready)


class Engram(nn.Module):
    """The gate of one Engram layer over the streams h [T, hc, hidden], given its rows [T, cols, head_dim]."""

    def __init__(self, hidden: int, hc_mult: int, num_cols: int, head_dim: int, num_rows: int, eps: float):
        super().__init__()
        self.hidden, self.hc_mult, self.eps = hidden, hc_mult, eps
        self.embed = EngramTable(num_rows, head_dim)
        self.wkv = Linear(num_cols * head_dim, hidden * (hc_mult + 1))
        self.q_weight = nn.Parameter(torch.empty(hc_mult, hidden), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(hc_mult, hidden), requires_grad=False)

    def forward(self, h: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """live [T] bool: False shuts the gate (image tokens pass through untouched)."""
        kv = self.wkv(rows.flatten(-2).to(h.dtype))
        key, value = kv.split([self.hc_mult * self.hidden, self.hidden], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.hidden))  # [T, hc, hidden]
        x = h.float()
        # normalized per (token, stream) over hidden; q_weight and k_weight only ever act as a product
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (x * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.hidden**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # [T, hc]
        if live is not None:
            gate = gate.masked_fill(~live[:, None], 0.0)
        return (x + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
