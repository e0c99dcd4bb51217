"""The TCP block transfer on its own: a real transfer server and real sockets on loopback, a plain dict
standing in for the block manager (the engine-level tests in tests/engine/test_kv_reuse.py pull through
real engines). Striped pulls are forced with a tiny minimum stripe size."""

import json
import socket
import struct
import threading

import pytest
import torch

from engine.kv.transfer import BlockLayout, KVTransferServer, StagingPool, TcpTransport, TransferError

MODEL = "model-key"
LAYOUT = BlockLayout((3, 4, 8), torch.bfloat16)  # [layers, block_size, dim]: 192 bytes a block
NUM_BLOCKS = 40


class Peer:
    """A replica's cache as the transfer server sees it: blocks keyed by hash, some of them held."""

    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.blocks = torch.randn(NUM_BLOCKS, *LAYOUT.shape, generator=gen).to(LAYOUT.dtype)
        self.hashes = [i.to_bytes(16, "big") for i in range(NUM_BLOCKS)]
        self.held = set(range(NUM_BLOCKS))
        self.connections = 0  # served, counted once per server thread (one per connection)
        self._thread = threading.local()
        self._lock = threading.Lock()

    def gather(self, hashes: list[bytes], out: torch.Tensor) -> int:
        if not getattr(self._thread, "counted", False):
            self._thread.counted = True
            with self._lock:
                self.connections += 1
        n = 0
        for h in hashes:
            i = int.from_bytes(h, "big")
            if i not in self.held:
                break
            out[n] = self.blocks[i]
            n += 1
        return n


@pytest.fixture
def serve():
    servers = []

    def start(peer: Peer, **kw) -> KVTransferServer:
        server = KVTransferServer("127.0.0.1", 0, MODEL, LAYOUT, peer.gather, **kw)
        server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


def striped(num_stripes: int = 4, **kw) -> TcpTransport:
    """A transport that stripes even tiny pulls, its block size already learnt."""
    transport = TcpTransport(MODEL, 2.0, num_stripes=num_stripes, min_stripe_bytes=1, **kw)
    transport._block_bytes = LAYOUT.num_bytes
    return transport


def test_pull_returns_the_blocks_byte_for_byte(serve):
    peer = Peer()
    server = serve(peer, frame_bytes=3 * LAYOUT.num_bytes)  # several frames
    pulled = TcpTransport(MODEL, 2.0).pull(f"127.0.0.1:{server.port}", peer.hashes[5:30])
    assert pulled.data.dtype == LAYOUT.dtype and pulled.data.shape == (25, *LAYOUT.shape)
    assert torch.equal(pulled.data, peer.blocks[5:30])
    assert pulled.num_bytes == 25 * LAYOUT.num_bytes and pulled.seconds > 0


def test_first_pull_is_one_stream_then_large_pulls_are_striped(serve):
    peer = Peer()
    server = serve(peer)
    transport = TcpTransport(MODEL, 2.0, num_stripes=3, min_stripe_bytes=10 * LAYOUT.num_bytes)
    transport.pull(f"127.0.0.1:{server.port}", peer.hashes).release()
    assert peer.connections == 1  # the block size was not known yet
    assert [len(r) for r in transport.stripes(NUM_BLOCKS)] == [13, 13, 14]
    assert [len(r) for r in transport.stripes(25)] == [12, 13]  # each stripe >= 10 blocks
    assert len(transport.stripes(19)) == 1
    peer.connections = 0
    pulled = transport.pull(f"127.0.0.1:{server.port}", peer.hashes)
    assert peer.connections == 3
    assert torch.equal(pulled.data, peer.blocks)


def test_striped_pull_reassembles_blocks_in_order(serve):
    peer = Peer()
    server = serve(peer, frame_bytes=2 * LAYOUT.num_bytes)
    transport = striped(num_stripes=4)
    pulled = transport.pull(f"127.0.0.1:{server.port}", peer.hashes[3:])
    assert peer.connections == 4
    assert torch.equal(pulled.data, peer.blocks[3:])


def test_striped_pull_stops_at_the_first_short_stripe(serve):
    peer = Peer()
    peer.held -= {13, 21}  # stripes of 10 blocks: the 2nd comes back with 3, the 3rd with 1, the 4th full
    server = serve(peer, frame_bytes=2 * LAYOUT.num_bytes)
    pulled = striped(num_stripes=4).pull(f"127.0.0.1:{server.port}", peer.hashes)
    assert torch.equal(pulled.data, peer.blocks[:13])


def test_a_peer_holding_none_of_the_blocks_is_a_transfer_error(serve):
    peer = Peer()
    peer.held = set(range(10, NUM_BLOCKS))  # later blocks only: no leading run
    server = serve(peer)
    for transport in (TcpTransport(MODEL, 2.0), striped()):
        with pytest.raises(TransferError, match="none of the blocks"):
            transport.pull(f"127.0.0.1:{server.port}", peer.hashes)


def test_another_model_is_refused(serve):
    server = serve(Peer())
    with pytest.raises(TransferError, match="model mismatch"):
        TcpTransport("other-model", 2.0).pull(f"127.0.0.1:{server.port}", Peer().hashes)


class Proxy:
    """Forwards every connection to `target`; the `nth` one (0-based) corrupts or cuts its response after
    `at` bytes."""

    def __init__(self, target_port: int, nth: int, at: int, mode: str):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port, self.nth, self.at, self.mode = target_port, nth, at, mode
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        for i in range(100):
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.at if i == self.nth else None),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, at: int | None) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if at is not None and seen <= at < seen + len(data):
                    if self.mode == "cut":
                        dst.sendall(data[: at - seen])
                        break
                    data = bytearray(data)
                    data[at - seen] ^= 0x01
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # shutdown wakes the other direction's thread blocked in recv
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()


def test_a_corrupt_stripe_is_detected(serve):
    peer = Peer()
    server = serve(peer)
    proxy = Proxy(server.port, nth=2, at=1000, mode="flip")  # inside the third stripe's first frame
    try:
        with pytest.raises(TransferError, match="checksum mismatch"):
            striped(num_stripes=4).pull(f"127.0.0.1:{proxy.port}", peer.hashes)
    finally:
        proxy.close()


def test_a_corrupt_single_stream_is_detected(serve):
    peer = Peer()
    server = serve(peer, frame_bytes=4 * LAYOUT.num_bytes)
    proxy = Proxy(server.port, nth=0, at=5000, mode="flip")  # a later frame
    try:
        with pytest.raises(TransferError, match="checksum mismatch"):
            TcpTransport(MODEL, 2.0).pull(f"127.0.0.1:{proxy.port}", peer.hashes)
    finally:
        proxy.close()


def test_a_peer_dying_mid_stripe_is_a_transfer_error(serve):
    peer = Peer()
    server = serve(peer, frame_bytes=2 * LAYOUT.num_bytes)
    proxy = Proxy(server.port, nth=1, at=1200, mode="cut")
    try:
        with pytest.raises(TransferError, match="closed the connection"):
            striped(num_stripes=4).pull(f"127.0.0.1:{proxy.port}", peer.hashes)
    finally:
        proxy.close()


def test_a_silent_peer_times_out():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (in the backlog) and never answers
    try:
        with pytest.raises(TransferError, match="timed out"):
            TcpTransport(MODEL, 0.3).pull(f"127.0.0.1:{listener.getsockname()[1]}", Peer().hashes)
    finally:
        listener.close()


def test_a_released_buffer_is_reused_and_a_held_one_is_not(serve):
    peer = Peer()
    server = serve(peer)
    transport = TcpTransport(MODEL, 2.0)
    first = transport.pull(f"127.0.0.1:{server.port}", peer.hashes)
    held = transport.pull(f"127.0.0.1:{server.port}", peer.hashes)  # `first` not released yet
    assert held.data.data_ptr() != first.data.data_ptr()
    assert torch.equal(first.data, peer.blocks)
    first.release()
    again = transport.pull(f"127.0.0.1:{server.port}", peer.hashes[:5])
    assert again.data.data_ptr() == first.data.data_ptr()
    assert torch.equal(again.data, peer.blocks[:5])


def test_staging_pool_keeps_at_most_its_cap():
    pool = StagingPool(pin_memory=False, max_cached_bytes=(5 << 20) // 2)
    a, b = pool.take(1 << 20), pool.take(2 << 20)
    assert a.numel() == 1 << 20 and b.numel() == 2 << 20
    pool.give(b)
    pool.give(a)  # would exceed the cap: dropped
    assert pool.take(1000).data_ptr() == b.data_ptr()  # the smallest that fits
    assert pool.take(1000).data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_layout_from_a_bad_header_is_refused():
    good = LAYOUT.header()
    assert BlockLayout.from_header(good) == LAYOUT
    with pytest.raises(TransferError, match="size disagrees"):
        BlockLayout.from_header({**good, "block_bytes": good["block_bytes"] + 1})
    with pytest.raises(TransferError, match="unknown block dtype"):
        BlockLayout.from_header({**good, "dtype": "Tensor"})


def test_a_peer_speaking_nonsense_is_a_transfer_error():
    listener = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"\x00\x00\x00\x02[]")  # a well-framed header that is not an object
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        with pytest.raises(TransferError, match="malformed header"):
            TcpTransport(MODEL, 2.0).pull(f"127.0.0.1:{listener.getsockname()[1]}", Peer().hashes)
    finally:
        listener.close()


def test_the_server_hangs_up_on_other_protocols_and_keeps_serving(serve):
    peer = Peer()
    server = serve(peer)
    bad_hashes = json.dumps({"model": MODEL, "hashes": [1]}).encode()
    for request in (b"DSKV\x00\x00\x00\x02{}",  # the first wire format
                    b"DSK2\x00\x00\x00\x02[]", b"DSK2" + struct.pack(">I", len(bad_hashes)) + bad_hashes):
        with socket.create_connection(("127.0.0.1", server.port), timeout=2.0) as sock:
            sock.sendall(request)
            assert sock.recv(65536) == b""  # closed without an answer
    pulled = TcpTransport(MODEL, 2.0).pull(f"127.0.0.1:{server.port}", peer.hashes[:3])
    assert torch.equal(pulled.data, peer.blocks[:3])
