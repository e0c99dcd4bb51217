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
        than by block. Then a block travels with its window section and one byte more, whether that
        section holds the block's window rows (its page was held throughout the copy); the puller keeps
        the longest run of the blocks it got whose trailing blocks came with them, and writes the window
        rows of those trailing blocks only. A server serves frames and stripes of a pull alike, without
        knowing where the puller's cut will fall."""
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
        # + one byte a block where the window has pages: whether its window section is its rows
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in kv_caches) + (1 if self.windowed else 0)
        # V3: one latent cache per layer, alike: a block is [layers, block_size, dim] on the wire. Caches of
        # several kinds (V4's window, entries, indexer keys, float32 state) travel as each block's bytes,
        # cache after cache, over TCP (the RDMA reads address alike per-layer rows)
        self.uniform = all(c.shape == kv_caches[0].shape and c.dtype == kv_caches[0].dtype for c in kv_caches)
        if self.uniform:
            layout = BlockLayout((len(kv_caches), *kv_caches[0].shape[1:]), kv_caches[0].dtype)
        else:
            layout = BlockLayout((self.block_bytes,), torch.uint8)
        self.byte_rows = [c.view(c.shape[0], -1).view(torch.uint8) for c in kv_caches]  # [blocks, row bytes]
        ends = list(itertools.accumulate(r.shape[1] for r in self.byte_rows))
        self.byte_ranges = list(zip([0, *ends[:-1]], ends))  # where each cache's row lies in a block's bytes
        self.auth = PeerAuth(config.secret)
        if not self.auth.enabled:
            logger.warning("KV transfer without a fleet secret (--kv-secret-file): any peer that reaches port %d "
                           "can read cached prompts", config.transfer_port)
        bind = config.transfer_host or config.advertise_host  # the pod IP, never every interface by default
        self.server = KVTransferServer(bind, config.transfer_port, model_key, layout, self._gather, auth=self.auth)
        served = ServedCache(kv_caches, block_manager.lookup_cached, self._served, config.advertise_host,
                             self.server.port, bind, self.auth) if self.uniform else None
        self.transport, transport_name = select_transport(config.transport, model_key, config.timeout, self.stats,
                                                          served, streams=config.transfer_streams, auth=self.auth,
                                                          layout=layout)
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
        if self.windowed:  # blocks without a page send the scratch page's rows, marked as not theirs
            held_pages = self.bm.lookup_pages(held)
            pages = torch.tensor([p if p >= 0 else self.bm.scratch_page for p, _ in held_pages], device=device)
        rows = out[: len(held)]
        # one block's rows of every layer, contiguous per block; on a GPU gathered there, then one copy
        staged = rows if device == rows.device else torch.empty(rows.shape, dtype=rows.dtype, device=device)
        if self.uniform:
            for layer, cache in enumerate(self.kv_caches):
                torch.index_select(cache, 0, ids, out=staged[:, layer])
        else:
            for i, ((start, end), cache) in enumerate(zip(self.byte_ranges, self.byte_rows)):
                staged[:, start:end] = cache.index_select(0, pages if self.windowed and self.windowed[i] else ids)
        if staged is not rows:
            rows.copy_(staged)
        valid = self.bm.still_valid(held)
        if self.windowed:
            rows[:, -1] = torch.tensor(self.bm.pages_unchanged(held_pages), dtype=torch.uint8)
        self.stats.served_blocks += valid
        return valid

    # -- pulling (engine loop + pool) ----------------------------------------------------------------
    def start_pull(self, hashes: list[bytes], num_local_blocks: int) -> PendingPull | None:
        """Called by the engine loop for a new request whose prefix is not all local."""
        wanted = hashes[num_local_blocks:]
        if not wanted or len(hashes) * self.bm.block_size < self.config.min_prefix_tokens:
            return None
        return PendingPull(wanted, num_local_blocks, self.pool.submit(self._pull, wanted))

    def _pull(self, wanted: list[bytes]) -> PulledBlocks | None:
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
        self.transfer_rate.update(pulled.num_bytes, pulled.seconds)
        self.stats.pulls += 1
        self.stats.pulled_blocks += pulled.data.shape[0]
        self.stats.transfer_bytes += pulled.num_bytes
        self.stats.transfer_seconds += pulled.seconds
        return pulled

    def install(self, pending: PendingPull, token_ids: list[list[int]]) -> list[int]:
        """Engine loop: write pulled blocks into the cache; returns their (pinned) block ids."""
        future = pending.future
        if not future.done() or future.cancelled():
            return []
        if future.exception() is not None:  # _pull catches what it expects; anything else recomputes too
            logger.warning("KV pull failed unexpectedly; recomputing", exc_info=future.exception())
            self.stats.fallback("protocol")
            return []
        pulled = future.result()
        if pulled is None:
            return []
        try:
            return self._install(pulled, pending.hashes, token_ids)
        finally:
            pulled.release()  # the transport reuses its buffer

    def _install(self, pulled: PulledBlocks, hashes: list[bytes], token_ids: list[list[int]]) -> list[int]:
        k = pulled.data.shape[0]
        expected = ((len(self.kv_caches), *self.kv_caches[0].shape[1:]) if self.uniform else (self.block_bytes,))
        if tuple(pulled.data.shape[1:]) != expected:
            self.stats.fallback("shape_mismatch")
            return []
        window_from = 0
        if self.windowed:
            # the longest run whose trailing blocks came with their window rows; where its cut reads further
            # back, into the local blocks, admission checks those (`match_prefix`)
            with_rows = pulled.data[:k, -1].tolist()
            k = self.bm.windowed_cut(list(range(k)), lambda i: with_rows[i] == 1)
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
            if self.windowed:
                pages = torch.tensor([self.bm.page_of[b] for b in ids[window_from:]], device=dev)
            for i, ((start, end), cache) in enumerate(zip(self.byte_ranges, self.byte_rows)):
                if self.windowed and self.windowed[i]:
                    cache.index_copy_(0, pages, data[window_from:, start:end].contiguous())
                else:
                    cache.index_copy_(0, index, data[:, start:end].contiguous())
        self.bm.announce(hashes[:k])
        return ids

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefill_rate.update(num_tokens, seconds)
