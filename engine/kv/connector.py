"""Glue between one engine and the fleet's KV cache: publish what we hold, serve it, pull what peers hold.

Threads: the engine loop owns the block manager and the cache; the directory publishes on its own
thread; the transfer server exports on its threads (reading the cache rows and checking afterwards
that the blocks were not reused meanwhile); pulls run on a small pool and are installed by the engine
loop. Every failure on the pull path ends in recomputation, never in an error for the request.
"""

import itertools
import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.kv.directory import KVDirectory
from engine.kv.auth import PeerAuth
from engine.kv.transfer import BlockLayout, KVTransferServer, PulledBlocks, TcpTransport, TransferError
from engine.kv.transport import ServedCache, select_transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVConfig:
    directory_url: str
    replica_id: str | None = None  # default: a random name
    advertise_host: str = "127.0.0.1"
    transfer_host: str | None = None  # the address the transfer port listens on (None: advertise_host)
    transfer_port: int = 8100  # 0: any free port
    secret: bytes | None = None  # the fleet's KV secret: peers authenticate, directory records are signed
    transport: str = "auto"  # auto | tcp | rdma
    transfer_streams: int | None = None  # TCP connections per large pull (None: min(4, usable cores))
    min_prefix_tokens: int = 64
    pull_policy: str = "auto"  # auto: when the estimated pull beats recomputing | always | never
    heartbeat_ttl: float = 15.0
    timeout: float = 5.0


@dataclass
class KVStats:
    """Counters the server exposes as metrics."""

    pulls: int = 0
    pulled_blocks: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count
    served_blocks: int = 0

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


class RateEstimate:
    """An exponential moving average of a rate, with a prior until measured."""

    def __init__(self, prior: float, alpha: float = 0.3):
        self.value, self.alpha = prior, alpha

    def update(self, amount: float, seconds: float) -> None:
        if seconds > 0 and amount > 0:
            self.value = (1 - self.alpha) * self.value + self.alpha * (amount / seconds)


def should_pull(num_tokens: int, num_bytes: int, transfer_rate: float, prefill_rate: float,
                min_tokens: int, policy: str) -> bool:
    """Pull a prefix only if it is long enough and moving it is expected to beat recomputing it."""
    if policy == "never" or num_tokens < min_tokens:
        return False
    if policy == "always":
        return True
    return num_bytes / transfer_rate < num_tokens / prefill_rate


@dataclass
class PulledPrefix:
    """What a pull brought: the blocks (every kind but a window in pages of its own) and, for a window in
    pages, the trailing blocks' window rows (None: none came)."""

    blocks: PulledBlocks
    window: PulledBlocks | None = None

    def release(self) -> None:
        self.blocks.release()
        if self.window is not None:
            self.window.release()


def _ranges(rows: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Where each cache's row bytes lie in one block's bytes, cache after cache."""
    ends = list(itertools.accumulate(r.shape[1] for r in rows))
    return list(zip([0, *ends[:-1]], ends))


# a pull's second part, V4's window rows, is asked for under the model's key with this added
WINDOW_PART = "/window"


@dataclass
class PendingPull:
    hashes: list[bytes]  # what we asked for (leading blocks beyond the local hit)
    first_block: int  # index of hashes[0] among the sequence's blocks
    future: Future


def redact_url(url: str) -> str:
    """The URL without its password (redis://:secret@host -> redis://:***@host), for logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***" if parts.username else ":***"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


class KVConnector:
    def __init__(self, config: KVConfig, block_manager: BlockManager, kv_caches: list[torch.Tensor], model_key: str,
                 windowed: list[bool] | None = None):
        """windowed: per cache, whether it is paged by the block manager's window pages (`page_of`) rather
        than by block (V4's window). Then a pull comes in two parts: every block's other kinds, then the
        window rows of the trailing blocks its cut reads (asked for under `model_key + WINDOW_PART`), each
        with one byte more: whether the server held the block's page throughout the copy. The puller
        keeps the blocks only where the trailing ones came with their rows, else it recomputes."""
        self.config = config
        self.windowed = windowed if windowed is not None and any(windowed) else None
        self.bm = block_manager
        self.kv_caches = kv_caches
        self.model_key = model_key
        self.replica_id = config.replica_id or f"replica-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex  # a restart is a new incarnation: old entries die with the old one
        self.stats = KVStats()
        self.transfer_rate = RateEstimate(prior=1e9)  # bytes/s
        self.prefill_rate = RateEstimate(prior=5e3)  # tokens/s
        # V3: one latent cache per layer, alike: a block is [layers, block_size, dim] on the wire. Caches of
        # several kinds (V4's window, entries, indexer keys, float32 state) travel as each block's bytes,
        # cache after cache, over TCP (the RDMA reads address alike per-layer rows); a window in pages of its
        # own travels apart, a page's bytes and the byte that says they are the block's
        self.uniform = all(c.shape == kv_caches[0].shape and c.dtype == kv_caches[0].dtype for c in kv_caches)
        is_window = self.windowed or [False] * len(kv_caches)
        byte_rows = [c.view(c.shape[0], -1).view(torch.uint8) for c in kv_caches]  # [blocks or pages, row bytes]
        self.byte_rows = [r for r, w in zip(byte_rows, is_window) if not w]
        self.window_rows = [r for r, w in zip(byte_rows, is_window) if w]
        self.byte_ranges = _ranges(self.byte_rows)  # where each cache's row lies in a block's bytes
        self.window_ranges = _ranges(self.window_rows)
        self.block_bytes = sum(r.shape[1] for r in self.byte_rows)
        self.window_bytes = sum(r.shape[1] for r in self.window_rows) + 1
        if self.uniform:
            layout = BlockLayout((len(kv_caches), *kv_caches[0].shape[1:]), kv_caches[0].dtype)
        else:
            layout = BlockLayout((self.block_bytes,), torch.uint8)
        self.auth = PeerAuth(config.secret)
        if not self.auth.enabled:
            logger.warning("KV transfer without a fleet secret (--kv-secret-file): any peer that reaches port %d "
                           "can read cached prompts", config.transfer_port)
        bind = config.transfer_host or config.advertise_host  # the pod IP, never every interface by default
        window_layout = BlockLayout((self.window_bytes,), torch.uint8)
        parts = {model_key + WINDOW_PART: (window_layout, self._gather_window)} if self.windowed else None
        self.server = KVTransferServer(bind, config.transfer_port, model_key, layout, self._gather, auth=self.auth,
                                       parts=parts)
        served = ServedCache(kv_caches, block_manager.lookup_cached, self._served, config.advertise_host,
                             self.server.port, bind, self.auth) if self.uniform else None
        self.transport, transport_name = select_transport(config.transport, model_key, config.timeout, self.stats,
                                                          served, streams=config.transfer_streams, auth=self.auth,
                                                          layout=layout)
        # a few blocks' window rows a pull: one stream
        self.window_transport = TcpTransport(model_key + WINDOW_PART, config.timeout, num_stripes=1, auth=self.auth,
                                             layout=window_layout) if self.windowed else None
        addr = self.transport.addr if transport_name == "rdma" else f"{config.advertise_host}:{self.server.port}"
        self.directory = KVDirectory(config.directory_url, model_key, self.replica_id, self.incarnation,
                                     addr, transport_name,
                                     heartbeat_ttl=config.heartbeat_ttl, auth=self.auth)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")
        block_manager.on_cached = self.directory.publish
        block_manager.on_evicted = self.directory.unpublish

    def start(self) -> None:
        self.server.start()
        self.directory.start()
        logger.info("KV reuse on: replica %s (incarnation %s), transfer %s at %s:%d%s, directory %s",
                    self.replica_id, self.incarnation[:8], self.transport.name, self.config.advertise_host,
                    self.server.port, " (authenticated)" if self.auth.enabled else "",
                    redact_url(self.config.directory_url))

    def stop(self) -> None:
        self.directory.close_replica()
        self.directory.stop()
        self.server.stop()
        if transport_close := getattr(self.transport, "close", None):
            transport_close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _served(self, held: list[tuple[int, int]]) -> int:
        """RDMA reads of these blocks ended: how many leading ones were not reused meanwhile."""
        valid = self.bm.still_valid(held)
        self.stats.served_blocks += valid
        return valid

    # -- exporting (transfer-server threads) ---------------------------------------------------------
    def _gather(self, hashes: list[bytes], out: torch.Tensor) -> int:
        """Copy the leading blocks held here into out [len(hashes), layers, block_size, dim] (host);
        returns how many are valid: rows copied from a block reused meanwhile are dropped."""
        held = self.bm.lookup_cached(hashes)
        if not held:
            return 0
        device = self.kv_caches[0].device
        ids = torch.tensor([b for b, _ in held], device=device)
        rows = out[: len(held)]
        # one block's rows of every layer, contiguous per block; on a GPU gathered there, then one copy
        staged = rows if device == rows.device else torch.empty(rows.shape, dtype=rows.dtype, device=device)
        if self.uniform:
            for layer, cache in enumerate(self.kv_caches):
                torch.index_select(cache, 0, ids, out=staged[:, layer])
        else:
            for (start, end), cache in zip(self.byte_ranges, self.byte_rows):
                staged[:, start:end] = cache.index_select(0, ids)
        if staged is not rows:
            rows.copy_(staged)
        valid = self.bm.still_valid(held)
        self.stats.served_blocks += valid
        return valid

    def _gather_window(self, hashes: list[bytes], out: torch.Tensor) -> int:
        """The window rows of the leading blocks held here into out [len(hashes), window_bytes] (host), each
        row's last byte 1 where they are the block's (its page held before and after the copy), 0 where
        they are the scratch page's (none held) -> how many blocks are valid."""
        held = self.bm.lookup_cached(hashes)
        if not held:
            return 0
        device = self.kv_caches[0].device
        pages = self.bm.lookup_pages(held)
        index = torch.tensor([p if p >= 0 else self.bm.scratch_page for p, _ in pages], device=device)
        rows = out[: len(held)]
        staged = rows if device == rows.device else torch.empty(rows.shape, dtype=rows.dtype, device=device)
        for (start, end), cache in zip(self.window_ranges, self.window_rows):
            staged[:, start:end] = cache.index_select(0, index)
        if staged is not rows:
            rows.copy_(staged)
        rows[:, -1] = torch.tensor(self.bm.pages_unchanged(pages), dtype=torch.uint8)
        return self.bm.still_valid(held)

    # -- pulling (engine loop + pool) ----------------------------------------------------------------
    def start_pull(self, hashes: list[bytes], num_local_blocks: int) -> PendingPull | None:
        """Called by the engine loop for a new request whose prefix is not all local."""
        wanted = hashes[num_local_blocks:]
        if not wanted or len(hashes) * self.bm.block_size < self.config.min_prefix_tokens:
            return None
        return PendingPull(wanted, num_local_blocks, self.pool.submit(self._pull, wanted))

    def _pull(self, wanted: list[bytes]) -> "PulledPrefix | None":
        forged = self.directory.num_forged
        try:
            peer = self.directory.lookup(wanted)
        except Exception:  # a record no well-behaved replica wrote: recompute, never crash
            logger.warning("KV directory lookup failed unexpectedly; recomputing", exc_info=True)
            self.stats.fallback("protocol")
            return None
        if peer is None:
            if self.directory.num_forged > forged:
                self.stats.fallback("unsigned_entry")
            elif not self.directory.healthy:
                self.stats.fallback("directory_unavailable")
            return None
        tokens = peer.num_blocks * self.bm.block_size
        if not should_pull(tokens, peer.num_blocks * self.block_bytes, self.transfer_rate.value,
                           self.prefill_rate.value, self.config.min_prefix_tokens, self.config.pull_policy):
            self.stats.fallback("recompute_cheaper")
            return None
        try:
            pulled = self.transport.pull(peer.addr, wanted[: peer.num_blocks])
        except TransferError as e:
            reason = "checksum" if "checksum" in str(e) else "transfer_failed"
            logger.warning("KV pull from %s failed (%s); recomputing", peer.replica_id, e)
            self.stats.fallback(reason)
            return None
        except Exception:  # a hostile or broken peer: whatever it did, this request recomputes
            logger.warning("KV pull from %s failed unexpectedly; recomputing", peer.replica_id, exc_info=True)
            self.stats.fallback("protocol")
            return None
        rows = self._pull_window(peer, wanted[: pulled.data.shape[0]]) if self.windowed else None
        num_bytes = pulled.num_bytes + (rows.num_bytes if rows is not None else 0)
        seconds = pulled.seconds + (rows.seconds if rows is not None else 0.0)
        self.transfer_rate.update(num_bytes, seconds)
        self.stats.pulls += 1
        self.stats.pulled_blocks += pulled.data.shape[0]
        self.stats.transfer_bytes += num_bytes
        self.stats.transfer_seconds += seconds
        return PulledPrefix(pulled, rows)

    def _pull_window(self, peer, got: list[bytes]) -> PulledBlocks | None:
        """The window rows of the trailing blocks of the `got` run (those its cut reads); None where the
        peer holds none of them any more or the pull fails (the puller then recomputes)."""
        try:
            return self.window_transport.pull(peer.addr, got[max(0, len(got) - self.bm.window_tail):])
        except Exception as e:  # TransferError, or a broken peer: the blocks go unused, recomputed
            logger.warning("KV pull of window rows from %s failed (%s); recomputing", peer.replica_id, e)
            return None

    def install(self, pending: PendingPull, token_ids: list[list[int]]) -> list[int]:
        """Engine loop: write pulled blocks into the cache; returns their (pinned) block ids."""
        future = pending.future
        if not future.done() or future.cancelled():
            return []
        if future.exception() is not None:  # _pull catches what it expects; anything else recomputes too
            logger.warning("KV pull failed unexpectedly; recomputing", exc_info=future.exception())
            self.stats.fallback("protocol")
            return []
        prefix = future.result()
        if prefix is None:
            return []
        try:
            return self._install(prefix, pending.hashes, token_ids)
        finally:
            prefix.release()  # the transport reuses its buffers

    def _install(self, prefix: "PulledPrefix", hashes: list[bytes], token_ids: list[list[int]]) -> list[int]:
        pulled = prefix.blocks
        k = pulled.data.shape[0]
        expected = ((len(self.kv_caches), *self.kv_caches[0].shape[1:]) if self.uniform else (self.block_bytes,))
        if tuple(pulled.data.shape[1:]) != expected:
            self.stats.fallback("shape_mismatch")
            return []
        window_from = first_row = 0
        if self.windowed:
            # the blocks whose window rows came (the run's trailing ones, from first_row on), and of those the
            # ones that are the blocks' own; where the cut reads further back, into the local blocks,
            # admission checks those (`match_prefix`)
            rows = prefix.window
            first_row = max(0, k - self.bm.window_tail)
            if rows is not None and tuple(rows.data.shape[1:]) != (self.window_bytes,):
                self.stats.fallback("shape_mismatch")
                return []
            own = [0] * first_row + (rows.data[:, -1].tolist() if rows is not None else [])
            k = self.bm.windowed_cut(list(range(k)), lambda i: i < len(own) and own[i] == 1)
            if k == 0:
                self.stats.fallback("window_evicted")
                return []
            window_from = max(0, k - self.bm.window_tail)
        ids = self.bm.install(hashes[:k], token_ids[:k], window_from)
        if ids is None:
            self.stats.fallback("no_space")
            return []
        dev = self.kv_caches[0].device
        index = torch.tensor(ids, device=dev)
        data = pulled.data[:k].to(dev, non_blocking=True)
        if self.uniform:
            for layer, cache in enumerate(self.kv_caches):
                cache.index_copy_(0, index, data[:, layer].to(cache.dtype))
        else:
            for (start, end), cache in zip(self.byte_ranges, self.byte_rows):
                cache.index_copy_(0, index, data[:, start:end].contiguous())
        if self.windowed:
            pages = torch.tensor([self.bm.page_of[b] for b in ids[window_from:]], device=dev)
            rows = prefix.window.data[window_from - first_row: k - first_row].to(dev, non_blocking=True)
            for (start, end), cache in zip(self.window_ranges, self.window_rows):
                cache.index_copy_(0, pages, rows[:, start:end].contiguous())
        self.bm.announce(hashes[:k])
        return ids

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefill_rate.update(num_tokens, seconds)
