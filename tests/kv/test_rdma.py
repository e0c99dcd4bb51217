"""The RDMA transport's whole pull path over Mooncake's TCP transport (this machine has no RDMA device):
two real transfer engines in one process, real sockets, a real block manager deciding what is held and
what was reused. What only RDMA hardware exercises (verbs, memory registration limits, GPUDirect) is not
covered here."""

import socket
import threading
import time

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (the rdma extra) cannot be loaded here",
                    exc_type=ImportError)

from engine.block_manager import BlockManager, block_hash  # noqa: E402
from engine.kv.connector import KVStats  # noqa: E402
from engine.kv.rdma import RdmaTransport, ServedCache  # noqa: E402
from engine.kv.transfer import BlockLayout, KVTransferServer, TcpTransport, TransferError  # noqa: E402

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, DIM = 3, 16, 4, 8
MODEL = "model-key"
BLOCK_BYTES = NUM_LAYERS * BLOCK_SIZE * DIM * 2  # bfloat16


class Replica:
    """One side: per-layer caches of random content and a block manager holding prefixes under their hashes.
    `reset` refills the same cache tensors (registered with a transfer engine once) for the next test."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.bfloat16):
        self.caches = [torch.empty(NUM_BLOCKS, BLOCK_SIZE, DIM, dtype=dtype) for _ in range(NUM_LAYERS)]
        self.seed = seed
        self.stats = KVStats()  # the transports keep it: reset clears it
        self.reset(seed)

    def reset(self, seed: int) -> "Replica":
        gen = torch.Generator().manual_seed(seed)
        for c in self.caches:
            c.copy_(torch.randn(c.shape, generator=gen))
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.stats.fallbacks.clear()
        return self

    def cache_prefix(self, num_blocks: int, num_held: int | None = None) -> list[bytes]:
        """Hashes of a `num_blocks`-block prefix (one of this replica's own), the leading `num_held` cached here."""
        first = 1000 * self.seed
        tokens = [list(range(first + i * BLOCK_SIZE, first + (i + 1) * BLOCK_SIZE)) for i in range(num_blocks)]
        hashes, parent = [], self.bm.root_hash
        for t in tokens:
            parent = block_hash(parent, t)
            hashes.append(parent)
        held = num_blocks if num_held is None else num_held
        self.bm.unpin(self.bm.install(hashes[:held], tokens[:held]))
        return hashes

    def evict(self, num_blocks: int) -> None:
        """This replica's engine takes every free block, then `num_blocks` of the cached ones (LRU first)."""
        n = self.bm.num_free_blocks - len(self.bm.hash_to_block) + num_blocks
        self.bm.install([bytes([i]) * 16 for i in range(n)], [[0] * BLOCK_SIZE] * n)

    def blocks(self, hashes: list[bytes]) -> torch.Tensor:
        """What a pull of these hashes should return: [k, layers, block_size, dim]."""
        ids = [b for b, _ in self.bm.lookup_cached(hashes)]
        return torch.stack([torch.stack([c[i] for c in self.caches]) for i in ids])

    def gather(self, hashes: list[bytes], out: torch.Tensor) -> int:
        """The TCP transfer server's view of this replica."""
        n = len(self.bm.lookup_cached(hashes))
        if n:
            out[:n] = self.blocks(hashes)
        return n

    def served(self, tcp_port: int = 1) -> ServedCache:
        return ServedCache(self.caches, lambda hashes: self.bm.lookup_cached(hashes),
                           lambda held: self.bm.still_valid(held), "127.0.0.1", tcp_port)

    def open(self, tcp_port: int = 1, model_key: str = MODEL, timeout: float = 2.0,
             staging_bytes: int = 2 * BLOCK_BYTES) -> RdmaTransport:
        """An RDMA transport on Mooncake's TCP protocol; its staging holds two blocks (pulls take rounds)."""
        return RdmaTransport.open(self.served(tcp_port), model_key, timeout, self.stats, ["mlx5_0"], "tcp",
                                  staging_bytes=staging_bytes)


def start_tcp_server(replica: Replica) -> KVTransferServer:
    layout = BlockLayout((NUM_LAYERS, BLOCK_SIZE, DIM), replica.caches[0].dtype)
    server = KVTransferServer("127.0.0.1", 0, MODEL, layout, replica.gather)
    server.start()
    return server


class AfterRead:
    """A Mooncake engine that runs `hook` after each batch of reads (fault injection); the rest delegates."""

    def __init__(self, engine, hook):
        self.engine, self.hook = engine, hook

    def batch_transfer_sync_read(self, *args):
        rc = self.engine.batch_transfer_sync_read(*args)
        self.hook()
        return rc

    def __getattr__(self, name):
        return getattr(self.engine, name)


# Transfer engines take a second to shut down: the two main ones live for the module.
@pytest.fixture(scope="module")
def sides():
    a, b = Replica(0), Replica(1)
    tcp = start_tcp_server(a)
    peer, puller = a.open(tcp_port=tcp.port), b.open()
    yield a, b, peer, puller
    peer.close()
    puller.close()
    tcp.stop()


@pytest.fixture
def a(sides):
    return sides[0].reset(0)


@pytest.fixture
def b(sides):
    return sides[1].reset(1)


@pytest.fixture
def peer(sides):
    return sides[2]


@pytest.fixture
def puller(sides):
    return sides[3]


def test_pull_reads_the_peer_blocks_byte_for_byte(a, b, peer, puller):
    hashes = a.cache_prefix(5)  # rounds of 2 + 2 + 1 blocks through the staging buffer
    before = [c.clone() for c in a.caches]
    pulled = puller.pull(peer.addr, hashes)
    assert pulled.data.dtype == torch.bfloat16 and pulled.data.shape == (5, NUM_LAYERS, BLOCK_SIZE, DIM)
    assert torch.equal(pulled.data.view(torch.int16), a.blocks(hashes).view(torch.int16))
    assert pulled.num_bytes == 5 * BLOCK_BYTES and pulled.seconds > 0
    assert all(torch.equal(x, y) for x, y in zip(a.caches, before))  # reads leave the peer untouched
    assert b.stats.fallbacks == {}


def test_pull_returns_the_leading_run_the_peer_still_holds(a, peer, puller):
    hashes = a.cache_prefix(6, num_held=4)
    assert torch.equal(puller.pull(peer.addr, hashes).data, a.blocks(hashes[:4]))


def test_a_peer_holding_nothing_is_a_transfer_error(a, b, peer, puller):
    hashes = b.cache_prefix(3)  # b's, not the peer's
    with pytest.raises(TransferError, match="none of the blocks"):
        puller.pull(peer.addr, hashes)


def test_corruption_in_flight_is_a_checksum_mismatch(a, peer, puller, monkeypatch):
    hashes = a.cache_prefix(4)

    def flip_a_bit():
        puller.staging[7] ^= 0x10

    monkeypatch.setattr(puller, "engine", AfterRead(puller.engine, flip_a_bit))
    with pytest.raises(TransferError, match="checksum mismatch"):
        puller.pull(peer.addr, hashes)


def test_blocks_reused_during_the_read_are_cut_from_the_pull(a, peer, puller, monkeypatch):
    hashes = a.cache_prefix(6)
    expected = a.blocks(hashes)
    monkeypatch.setattr(puller, "engine", AfterRead(puller.engine, lambda: a.evict(2)))
    pulled = puller.pull(peer.addr, hashes)
    assert torch.equal(pulled.data, expected[:4])  # the prefix's tail is evicted first


def test_every_block_reused_during_the_read_is_a_transfer_error(a, peer, puller, monkeypatch):
    hashes = a.cache_prefix(6)
    monkeypatch.setattr(puller, "engine", AfterRead(puller.engine, lambda: a.evict(6)))
    with pytest.raises(TransferError, match="reused"):
        puller.pull(peer.addr, hashes)


def test_a_dead_peer_is_a_transfer_error(b, puller):
    c = Replica(2)
    hashes = c.cache_prefix(4)
    dying = c.open()
    assert torch.equal(puller.pull(dying.addr, hashes).data, c.blocks(hashes))
    dying.close()
    start = time.monotonic()
    with pytest.raises(TransferError, match="failed"):
        puller.pull(dying.addr, hashes)
    assert time.monotonic() - start < 1.0


def test_a_peer_whose_transfer_engine_died_is_a_transfer_error(b, puller):
    c = Replica(2)
    hashes = c.cache_prefix(4)
    dying = c.open()
    try:
        del dying.engine  # its lessor still answers; the reads find nobody to read from
        with pytest.raises(TransferError, match="RDMA read"):
            puller.pull(dying.addr, hashes)
    finally:
        dying.lessor.stop()


def test_a_silent_peer_times_out(puller, monkeypatch):
    monkeypatch.setattr(puller, "timeout", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        start = time.monotonic()
        with pytest.raises(TransferError, match="timed out"):
            puller.pull(f"127.0.0.1:{silent.getsockname()[1]}", [bytes(16)])
    assert time.monotonic() - start < 2.0


def test_a_tcp_only_peer_is_pulled_over_tcp(b, puller):
    c = Replica(2)
    hashes = c.cache_prefix(5)
    server = start_tcp_server(c)
    try:
        pulled = puller.pull(f"127.0.0.1:{server.port}", hashes)
        assert torch.equal(pulled.data, c.blocks(hashes))
        pulled.release()
    finally:
        server.stop()
    assert b.stats.fallbacks == {"rdma_peer_unavailable": 1}


def test_a_tcp_puller_reaches_an_rdma_peer_at_its_advertised_address(a, peer):
    hashes = a.cache_prefix(5)
    pulled = TcpTransport(MODEL, 2.0).pull(peer.addr, hashes)  # through the lessor to a's TCP server
    assert torch.equal(pulled.data, a.blocks(hashes))
    pulled.release()


def test_another_model_is_refused(a, peer):
    hashes = a.cache_prefix(3)
    other = Replica(2).open(model_key="another-model")
    try:
        with pytest.raises(TransferError, match="model mismatch"):
            other.pull(peer.addr, hashes)
    finally:
        other.close()


def test_another_cache_layout_is_refused(a, peer):
    hashes = a.cache_prefix(3)
    other = Replica(2, torch.float32).open()
    try:
        with pytest.raises(TransferError, match="layout"):
            other.pull(peer.addr, hashes)
    finally:
        other.close()


def test_concurrent_pulls_take_turns_on_the_staging_buffer(a, peer, puller):
    hashes = a.cache_prefix(8)
    results, errors = [], []

    def pull(n: int):
        try:
            results.append((n, puller.pull(peer.addr, hashes[:n]).data))
        except TransferError as e:
            errors.append(e)

    threads = [threading.Thread(target=pull, args=(n,)) for n in (8, 5, 7, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(n for n, _ in results) == [3, 5, 7, 8]
    for n, data in results:
        assert torch.equal(data, a.blocks(hashes[:n]))
