"""The KV transfer's security contract, attack by attack, on loopback: a peer without the fleet's secret
reads nothing; a fake peer cannot pass as a replica; a forged directory record is ignored; a hostile or
slow peer costs a counted fallback, never a crash or an unbounded allocation; the Redis password stays
out of the logs."""

import logging
import socket
import struct
import threading
import time

import pytest
import torch

from engine.kv import transfer
from engine.kv.auth import AuthError, PeerAuth, read_secret
from engine.kv.connector import redact_url
from engine.kv.directory import KVDirectory
from engine.kv.transfer import MAGIC, TcpTransport, TransferError
from tests.kv.test_transfer import LAYOUT, MODEL, Peer, serve  # noqa: F401
from tests.redis_server import RedisServer

SECRET = b"fleet-secret-0123456789abcdef"


def test_a_peer_without_the_secret_reads_nothing(serve):  # noqa: F811
    peer = Peer()
    server = serve(peer, auth=PeerAuth(SECRET))
    addr = f"127.0.0.1:{server.port}"
    for auth in (None, PeerAuth(b"another-fleet-secret-0000")):
        with pytest.raises(TransferError):
            TcpTransport(MODEL, 2.0, auth=auth).pull(addr, peer.hashes[:4])
    deadline = time.monotonic() + 5  # the server notices the second client's hang-up a moment later
    while server.num_refused < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert peer.connections == 0 and server.num_refused == 2  # no hash was looked at, no block gathered
    pulled = TcpTransport(MODEL, 2.0, auth=PeerAuth(SECRET), layout=LAYOUT).pull(addr, peer.hashes[:4])
    assert torch.equal(pulled.data, peer.blocks[:4])


def test_a_fake_peer_cannot_pass_as_a_replica(serve):  # noqa: F811
    """A server that lacks the secret (or guesses one) fails the client's check of its MAC: the puller
    hangs up before sending a single hash."""
    for fake_auth in (None, PeerAuth(b"guessed-secret-0000000000")):
        fake = Peer(seed=1)
        server = serve(fake, auth=fake_auth)
        with pytest.raises(TransferError):
            TcpTransport(MODEL, 2.0, auth=PeerAuth(SECRET)).pull(f"127.0.0.1:{server.port}", fake.hashes[:4])
        assert fake.connections == 0


def test_a_recorded_handshake_does_not_verify_again():
    """The client's MAC covers the server's fresh nonce: replaying a recorded exchange fails."""
    nonce = b"\7" * 16

    def session(answer) -> bool:
        server_side, client_side = socket.socketpair()
        outcome = {}

        def serve():
            try:
                PeerAuth(SECRET).accept(server_side)
                outcome["ok"] = True
            except AuthError:
                outcome["ok"] = False

        thread = threading.Thread(target=serve)
        thread.start()
        client_side.sendall(b"DSKA" + nonce)
        reply = client_side.recv(48)
        client_side.sendall(answer(reply))
        thread.join(5)
        return outcome["ok"]

    recorded = {}
    honest = lambda reply: recorded.setdefault("mac", PeerAuth(SECRET)._mac(b"client", reply[:16], nonce))  # noqa
    assert session(honest)
    assert not session(lambda reply: recorded["mac"])


def test_a_forged_directory_record_is_ignored(tmp_path):
    redis = RedisServer(tmp_path).start()
    try:
        auth = PeerAuth(SECRET)
        a = KVDirectory(redis.url, "m", "a", "inc-a", "10.0.0.1:8100", auth=auth)
        b = KVDirectory(redis.url, "m", "b", "inc-b", "10.0.0.2:8100", auth=auth)
        assert a._beat()
        hashes = [bytes([i]) * 16 for i in range(3)]
        a._write([("add", hashes)])
        assert b.lookup(hashes).addr == "10.0.0.1:8100"  # signed by a: trusted
        # a Redis writer without the secret points a's record at a peer of its own
        redis.client().hset("dsf:m:replica:a", "addr", "10.6.6.6:8100")
        assert b.lookup(hashes) is None and b.num_forged == 1
        redis.client().hset("dsf:m:replica:a", "addr", "10.0.0.1:8100")
        assert b.lookup(hashes).addr == "10.0.0.1:8100"
        # a whole record written without the secret is no better: it is never the peer asked
        redis.client().hset("dsf:m:replica:evil", mapping={"incarnation": "x", "addr": "10.6.6.6:1", "sig": "00"})
        for h in hashes:
            redis.client().hset("dsf:m:block:" + h.hex(), "evil", "x")
        peer = b.lookup(hashes)
        assert peer is None or peer.addr == "10.0.0.1:8100"
        # records no replica writes: a non-ASCII signature, a missing address, bytes that are no UTF-8
        r = redis.client()
        r.delete("dsf:m:replica:evil")
        for broken in ({"sig": "sé€"}, {"addr": None}, {"addr": b"\xff\xfe"}):
            key = "dsf:m:replica:a"
            if broken.get("addr", 0) is None:
                r.hdel(key, "addr")
            else:
                r.hset(key, mapping=broken)
            assert b.lookup(hashes) is None  # ignored, never an exception
            a._registered = False
            assert a._beat()
    finally:
        redis.stop()


def test_a_hostile_header_is_refused_before_anything_is_allocated():
    """A peer announcing blocks of 4 TiB: the puller compares the layout with its own first."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def hostile():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            body = b'{"block_bytes": 4398046511104, "dtype": "uint8", "block_shape": [4398046511104]}'
            conn.sendall(struct.pack(">I", len(body)) + body)
            time.sleep(0.5)

    threading.Thread(target=hostile, daemon=True).start()
    transport = TcpTransport(MODEL, 2.0, layout=LAYOUT)
    taken = []
    real_take = transport.pool.take
    transport.pool.take = lambda n: taken.append(n) or real_take(n)
    with pytest.raises(TransferError, match="this replica's"):
        transport.pull(f"127.0.0.1:{port}", Peer().hashes[:2])
    assert taken == []
    listener.close()


def test_oversized_and_trickled_requests_are_dropped(serve, monkeypatch):  # noqa: F811
    monkeypatch.setattr(transfer, "HANDSHAKE_SECONDS", 0.5)
    peer = Peer()
    server = serve(peer)
    big = socket.create_connection(("127.0.0.1", server.port))
    big.sendall(MAGIC + struct.pack(">I", 64 << 20))  # claims 64 MiB: refused before reading it
    assert big.recv(1) == b""
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.sendall(MAGIC + struct.pack(">I", 1000))
    t0 = time.monotonic()
    slow.settimeout(5)
    try:
        while time.monotonic() - t0 < 4:
            slow.sendall(b" ")  # a byte at a time: the header deadline still ends it
            time.sleep(0.1)
        dropped = False
    except OSError:
        dropped = True
    assert dropped or slow.recv(1) == b""
    assert time.monotonic() - t0 < 3
    assert TcpTransport(MODEL, 2.0).pull(f"127.0.0.1:{server.port}", peer.hashes[:2]).data.shape[0] == 2  # serving
    with pytest.raises(TransferError, match="at most"):  # more hashes than any prompt has blocks
        TcpTransport(MODEL, 2.0).pull(f"127.0.0.1:{server.port}", [bytes(16)] * (transfer.MAX_HASHES + 1))


def test_connections_beyond_the_cap_are_closed(serve):  # noqa: F811
    peer = Peer()
    server = serve(peer, max_connections=4)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4 + 5)]
    deadline = time.monotonic() + 5
    while server.num_refused < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.num_refused >= 5
    for s in held:
        s.close()
    # the held connections' slots come back once their threads see them closed: until then a pull may still
    # find every slot taken (a refusal, which a replica answers by recomputing)
    deadline = time.monotonic() + 5
    while True:
        try:
            pulled = TcpTransport(MODEL, 2.0).pull(f"127.0.0.1:{server.port}", peer.hashes[:2])
            break
        except TransferError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert pulled.data.shape[0] == 2


def test_urls_are_redacted():  # the server's log itself: tests/e2e/test_kv_fleet.py
    assert redact_url("redis://:hunter2@kv.ns.svc:6379/0") == "redis://:***@kv.ns.svc:6379/0"
    assert redact_url("redis://app:hunter2@kv:6379") == "redis://app:***@kv:6379"
    assert redact_url("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_a_short_or_missing_secret_file_is_an_error(tmp_path):
    (tmp_path / "s").write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret(str(tmp_path / "s"))
    (tmp_path / "s").write_text(SECRET.decode() + "\n")
    assert read_secret(str(tmp_path / "s")) == SECRET


def test_a_tarpit_peer_is_abandoned_in_bounded_time():
    """A peer that answers one byte at a time: the pull gives up after its deadline (timeout plus the
    bytes at a minimum rate), so the request recomputes instead of waiting on it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def tarpit():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 << 16)
            try:
                for byte in struct.pack(">I", 100) + b"{" * 100:
                    conn.sendall(bytes([byte]))
                    time.sleep(0.3)
            except OSError:
                pass

    threading.Thread(target=tarpit, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        TcpTransport(MODEL, 1.0, layout=LAYOUT).pull(f"127.0.0.1:{listener.getsockname()[1]}", Peer().hashes[:2])
    assert time.monotonic() - t0 < 3
    listener.close()
