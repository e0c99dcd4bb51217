"""Peer-to-peer KV block transfer over TCP.

Wire format v2 (one request per round on a connection, big-endian):
  request:  b"DSK2" u32 len, JSON {"model": key, "hashes": [hex, ...]}
  response: u32 len, JSON {"block_bytes": n, "dtype": str, "block_shape": [...]} (or {"error": str}),
            then frames: u32 k, k * u64 xxh3_64 (one per block), k * n raw bytes; k == 0 ends the response
The server streams the longest run of leading blocks it still holds, one frame at a time: it gathers a
frame's rows into a small staging buffer, checksums them while they are hot in cache and sends them, so
a block reused meanwhile ends the run instead of going out stale. A large pull is striped: the client
splits the hashes into contiguous ranges, asks for each over its own connection in parallel, receives
every stripe straight into its place in one reused staging buffer and checks each frame as it lands.
A server may serve other parts of its blocks under keys of their own in the request's "model" (V4's
window rows: engine.kv.connector), each with its own layout.
"""

import json
import logging
import math
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

from engine.kv.auth import AuthError, PeerAuth

logger = logging.getLogger(__name__)

MAGIC = b"DSK2"  # v1 peers ("DSKV") and v2 peers hang up on each other: the puller recomputes
_LEN = struct.Struct(">I")
# Bounds checked before anything is allocated: a request names at most MAX_HASHES blocks (a 1M-token
# prompt in 16-token blocks), and its header (JSON, 34 bytes a hash) fits in _MAX_HEADER
MAX_HASHES = 1 << 16
_MAX_HEADER = 4 << 20
HANDSHAKE_SECONDS = 5.0  # the handshake and a request's header arrive within this, however they trickle
MAX_CONNECTIONS = 64  # connections served at once; more are closed at once
MIN_PULL_RATE = 20e6  # bytes/s: a pull slower than this (plus the timeout) is abandoned and recomputed

# Defaults, measured on loopback (docs/perf.md): frames large enough that per-frame work (a GPU gather
# and its sync, the Python between syscalls) stays small, small enough to stay in cache between gather,
# checksum and send (2 MiB frames win on 2 cores, 8 MiB on 16; 4 MiB is within 10% of both); a few
# streams because one TCP stream is bound by one core's copies.
FRAME_BYTES = 4 << 20
NUM_STRIPES = 4  # at most: never more than this process may use cores (each stream keeps one busy)
MIN_STRIPE_BYTES = 16 << 20


class TransferError(Exception):
    """A pull failed (peer gone, timeout, protocol or checksum error): the caller recomputes."""


@dataclass(frozen=True)
class BlockLayout:
    """What one block looks like on the wire: `shape` elements of `dtype`, contiguous."""

    shape: tuple[int, ...]  # [layers, block_size, dim] for the engine's caches
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def header(self) -> dict:
        return {"block_bytes": self.num_bytes, "dtype": str(self.dtype).removeprefix("torch."),
                "block_shape": list(self.shape)}

    @classmethod
    def from_header(cls, header: dict) -> "BlockLayout":
        dtype = getattr(torch, str(header["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise TransferError(f"unknown block dtype {header['dtype']!r}")
        layout = cls(tuple(int(d) for d in header["block_shape"]), dtype)
        if layout.num_bytes != header["block_bytes"] or layout.num_bytes <= 0:
            raise TransferError("block size disagrees with its shape")
        return layout

    def view(self, buffer: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """[num_blocks, *shape] over the front of a uint8 staging buffer."""
        return buffer[: num_blocks * self.num_bytes].view(self.dtype).view(num_blocks, *self.shape)


@dataclass
class PulledBlocks:
    data: torch.Tensor  # [k, *block_shape], a view into the transport's staging buffer
    num_bytes: int
    seconds: float
    release: Callable[[], None] = lambda: None  # call once `data` is copied out: its buffer gets reused


class StagingPool:
    """Host buffers reused across transfers (thread-safe). A fresh buffer costs more in page faults than
    the copy into it, and pinning one (so CUDA copies are DMA) costs more still."""

    def __init__(self, pin_memory: bool | None = None, max_cached_bytes: int = 4 << 30):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.max_cached_bytes = max_cached_bytes
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._lock = threading.Lock()

    def take(self, num_bytes: int) -> torch.Tensor:
        """A uint8 buffer of at least num_bytes (sizes round up to powers of two, as pinned memory does)."""
        with self._lock:
            fits = [i for i, (buf, _) in enumerate(self._free) if buf.numel() >= num_bytes]
            if fits:
                buf, ready = self._free.pop(min(fits, key=lambda i: self._free[i][0].numel()))
                if ready is not None:
                    ready.synchronize()  # a copy to the GPU may still read it
                return buf
        size = 1 << max(20, (num_bytes - 1).bit_length())
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)

    def give(self, buf: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        with self._lock:
            if sum(b.numel() for b, _ in self._free) + buf.numel() <= self.max_cached_bytes:
                self._free.append((buf, ready))


def block_checksums(data: torch.Tensor) -> list[int]:
    """xxh3_64 of each block's bytes; data: [k, ...] on the host."""
    raw = data.contiguous().view(torch.uint8).reshape(-1)
    return _checksums(memoryview(raw.numpy()), data[0].numel() * data.element_size() if len(data) else 1)


def _checksums(raw: memoryview, block_bytes: int) -> list[int]:
    return [xxhash.xxh3_64_intdigest(raw[i : i + block_bytes]) for i in range(0, len(raw), block_bytes)]


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill view from the socket. With a deadline, the whole read must end by then, however the bytes
    trickle in (each read waits only for what is left of it)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError("the peer is too slow")
            # the kernel spends this budget across the whole call, however the bytes trickle in
            _set_recv_timeout(sock, max(left, 1e-3))  # a zero timeval would mean "wait forever"
        try:  # MSG_WAITALL: a whole frame in one call (the kernel's SO_RCVTIMEO still bounds it)
            n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except BlockingIOError as e:
            raise TransferError("timed out waiting for the peer") from e
        if n == 0:
            raise TransferError("peer closed the connection mid-transfer")
        got += n


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def _next_request(sock: socket.socket) -> bool:
    """Whether another request follows (False once the peer hangs up or speaks another protocol)."""
    magic = sock.recv(len(MAGIC))
    if 0 < len(magic) < len(MAGIC):
        magic += _recv_exact(sock, len(MAGIC) - len(magic))
    return magic == MAGIC


def _send_json(sock: socket.socket, obj: dict, magic: bytes = b"") -> None:
    body = json.dumps(obj).encode()
    sock.sendall(magic + _LEN.pack(len(body)) + body)


def _recv_json(sock: socket.socket, deadline: float | None = None) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, 4, deadline))
    if n > _MAX_HEADER:
        raise TransferError(f"oversized header ({n} bytes)")
    obj = json.loads(_recv_exact(sock, n, deadline))
    if not isinstance(obj, dict):
        raise TransferError("malformed header")
    return obj


def _set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))


def _tune(sock: socket.socket, buffer_bytes: int, timeout: float) -> None:
    # Blocking, with the kernel's timeouts rather than Python's: a socket with a Python timeout is
    # non-blocking underneath, where MSG_WAITALL returns whatever has arrived.
    sock.settimeout(None)
    limit = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:  # 0 leaves the kernel's autotuning on (a fixed size turns it off)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


# gather(hashes, out) copies the leading blocks held here into out[:n] ([len(hashes), *layout.shape] on
# the host) and returns n, counting only blocks that were not reused while being copied.
Gather = Callable[[list[bytes], torch.Tensor], int]


class ConnectionServer:
    """A threaded TCP server handing each connection to `handle(sock)` on a daemon thread of its own, once
    the peer passed the fleet's handshake (`auth`); at most MAX_CONNECTIONS at once."""

    def __init__(self, host: str, port: int, handle: Callable[[socket.socket], None], name: str,
                 auth: PeerAuth | None = None, max_connections: int = MAX_CONNECTIONS):
        auth = auth or PeerAuth(None)
        slots = threading.BoundedSemaphore(max_connections)
        self.num_refused = 0  # connections that failed the handshake or found every slot taken

        def serve(sock: socket.socket) -> None:
            if not slots.acquire(blocking=False):
                self.num_refused += 1
                return
            try:
                sock.settimeout(HANDSHAKE_SECONDS)
                try:
                    auth.accept(sock, HANDSHAKE_SECONDS)
                except (AuthError, OSError) as e:
                    self.num_refused += 1
                    logger.warning("KV transfer: refused a connection from %s: %s", _peer(sock), e)
                    return
                handle(sock)
            finally:
                slots.release()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        # a short poll interval: stop() returns within it
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a peer"


class KVTransferServer:
    """Serves this replica's cached blocks to peers; `gather` runs on the server's connection threads.
    parts: more views of the same blocks, each asked for under a key of its own in place of the model's
    (key -> its layout and gather): V4's window rows, which a puller takes for a cut's trailing blocks only."""

    def __init__(self, host: str, port: int, model_key: str, layout: BlockLayout, gather: Gather, *,
                 frame_bytes: int = FRAME_BYTES, socket_buffer_bytes: int = 0, timeout: float = 30.0,
                 auth: PeerAuth | None = None, max_connections: int = MAX_CONNECTIONS,
                 parts: dict[str, tuple[BlockLayout, Gather]] | None = None):
        self.model_key = model_key
        self.layout = layout
        self.gather = gather
        self.frame_bytes = frame_bytes
        self.parts = {model_key: (layout, gather), **(parts or {})}
        self.blocks_per_frame = max(1, frame_bytes // layout.num_bytes)
        self.socket_buffer_bytes = socket_buffer_bytes
        self.timeout = timeout  # a stalled or silent client is dropped after this long
        self.pool = StagingPool()
        self._tcp = ConnectionServer(host, port, self._handle, "kv-transfer", auth, max_connections)
        self.port = self._tcp.port

    @property
    def num_refused(self) -> int:
        return self._tcp.num_refused

    def start(self) -> None:
        self._tcp.start()

    def stop(self) -> None:
        self._tcp.stop()

    def _handle(self, sock: socket.socket) -> None:
        _tune(sock, self.socket_buffer_bytes, self.timeout)
        try:
            while _next_request(sock):
                req = _recv_json(sock, time.monotonic() + HANDSHAKE_SECONDS)
                _set_recv_timeout(sock, self.timeout)
                part = self.parts.get(req.get("model")) if isinstance(req.get("model"), str) else None
                if part is None:
                    _send_json(sock, {"error": "model mismatch"})
                    continue
                wanted = req.get("hashes", [])
                if not isinstance(wanted, list) or len(wanted) > MAX_HASHES:
                    _send_json(sock, {"error": f"a pull names at most {MAX_HASHES} blocks"})
                    return
                hashes = [bytes.fromhex(h) for h in wanted]
                _send_json(sock, part[0].header())
                self._stream(sock, hashes, *part)
        except (OSError, TransferError, ValueError, TypeError) as e:  # the peer left or spoke nonsense
            logger.debug("KV transfer connection ended: %s", e)
        except Exception:  # e.g. the gather ran out of device memory: the peer sees a dead connection
            logger.warning("KV transfer: serving a pull failed", exc_info=True)

    def _stream(self, sock: socket.socket, hashes: list[bytes], layout: BlockLayout, gather: Gather) -> None:
        block_bytes = layout.num_bytes
        per_frame = max(1, self.frame_bytes // block_bytes)
        buf = self.pool.take(min(per_frame, max(1, len(hashes))) * block_bytes)
        raw = memoryview(buf.numpy())
        try:
            for first in range(0, len(hashes), per_frame):
                wanted = hashes[first : first + per_frame]
                n = gather(wanted, layout.view(buf, len(wanted)))
                if n:
                    sums = _checksums(raw[: n * block_bytes], block_bytes)
                    sock.sendall(_LEN.pack(n) + struct.pack(f">{n}Q", *sums))
                    sock.sendall(raw[: n * block_bytes])
                if n < len(wanted):
                    break
            sock.sendall(_LEN.pack(0))
        finally:
            self.pool.give(buf)


class _Aborted(TransferError):
    """A stripe stopped because another one failed."""


class _Landing:
    """One pull's receive buffer, taken from the pool once the first stripe's header names the layout."""

    def __init__(self, num_blocks: int, pool: StagingPool):
        self.num_blocks, self.pool = num_blocks, pool
        self.layout: BlockLayout | None = None
        self.buffer: torch.Tensor | None = None
        self._lock = threading.Lock()

    def claim(self, layout: BlockLayout) -> memoryview:
        with self._lock:
            if self.buffer is None:
                self.layout, self.buffer = layout, self.pool.take(self.num_blocks * layout.num_bytes)
            elif layout != self.layout:
                raise TransferError("stripes disagree on the block layout")
        return memoryview(self.buffer.numpy())

    def release(self) -> None:
        with self._lock:
            buf, self.buffer = self.buffer, None
        if buf is not None:
            self.pool.give(buf, ready=_gpu_done() if buf.is_pinned() else None)


def _gpu_done() -> torch.cuda.Event:
    """An event behind the copies this thread has queued (a pinned buffer may still be their source)."""
    event = torch.cuda.Event()
    event.record()
    return event


class TcpTransport:
    """Pulls blocks from a peer's KVTransferServer, striped over several connections when large."""

    name = "tcp"

    def __init__(self, model_key: str, timeout: float = 5.0, *, num_stripes: int | None = None,
                 min_stripe_bytes: int = MIN_STRIPE_BYTES, socket_buffer_bytes: int = 0,
                 pool: StagingPool | None = None, auth: PeerAuth | None = None, layout: BlockLayout | None = None):
        """layout: this replica's own blocks; a peer that announces another is refused before anything is
        allocated for it."""
        num_stripes = min(NUM_STRIPES, len(os.sched_getaffinity(0))) if num_stripes is None else num_stripes
        if num_stripes < 1:
            raise ValueError(f"num_stripes must be >= 1, got {num_stripes}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.model_key = model_key
        self.timeout = timeout  # per socket operation: a silent peer fails the pull after this long
        self.num_stripes = num_stripes
        self.min_stripe_bytes = min_stripe_bytes
        self.socket_buffer_bytes = socket_buffer_bytes
        self.pool = pool or StagingPool()
        self.auth = auth or PeerAuth(None)
        self.layout = layout
        self._block_bytes = 0  # learnt from the first response; until then a pull is one stream

    def stripes(self, num_blocks: int) -> list[range]:
        """Contiguous block ranges, one per connection: at most num_stripes, each >= min_stripe_bytes."""
        wanted = num_blocks * self._block_bytes // max(1, self.min_stripe_bytes)
        count = max(1, min(self.num_stripes, num_blocks, wanted))
        bounds = [num_blocks * i // count for i in range(count + 1)]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]

    def pull(self, addr: str, hashes: list[bytes]) -> PulledBlocks:
        host, _, port = addr.rpartition(":")
        start = time.perf_counter()
        landing = _Landing(len(hashes), self.pool)
        ranges = self.stripes(len(hashes))
        abort = threading.Event()  # one stripe failed: the others stop at their next frame
        try:
            if len(ranges) == 1:
                counts = [self._pull_stripe((host.strip("[]"), int(port)), hashes, ranges[0], landing, abort)]
            else:
                with ThreadPoolExecutor(len(ranges), thread_name_prefix="kv-stripe") as pool:
                    futures = [pool.submit(self._pull_stripe, (host.strip("[]"), int(port)), hashes, r, landing,
                                           abort) for r in ranges]
                errors = [e for f in futures if (e := f.exception()) is not None]
                if errors:  # report the stripe that failed first-hand, not the ones it stopped
                    raise next((e for e in errors if not isinstance(e, _Aborted)), errors[0])
                counts = [f.result() for f in futures]
            num_blocks = 0
            for r, n in zip(ranges, counts):  # the prefix ends at the first stripe that came back short
                num_blocks += n
                if n < len(r):
                    break
            if num_blocks == 0:
                raise TransferError("peer holds none of the blocks any more")
        except TransferError:
            landing.release()
            raise
        except (OSError, ValueError, KeyError, TypeError, struct.error, AuthError, RuntimeError) as e:
            landing.release()  # RuntimeError: torch refusing a hostile peer's layout, say
            raise TransferError(f"pull from {addr} failed: {e}") from e
        self._block_bytes = landing.layout.num_bytes
        data = landing.layout.view(landing.buffer, num_blocks)
        return PulledBlocks(data, num_blocks * landing.layout.num_bytes, time.perf_counter() - start,
                            release=landing.release)

    def _pull_stripe(self, addr: tuple[str, int], hashes: list[bytes], blocks: range, landing: _Landing,
                     abort: threading.Event) -> int:
        """Receives blocks[0], blocks[1], ... into their places; returns how many the peer sent."""
        try:
            block_bytes = self.layout.num_bytes if self.layout is not None else self._block_bytes or (1 << 20)
            # a peer that trickles (a tarpit) parks this pull worker no longer than this
            deadline = time.monotonic() + self.timeout + len(blocks) * block_bytes / MIN_PULL_RATE
            with socket.create_connection(addr, timeout=self.timeout) as sock:
                self.auth.connect(sock, self.timeout)
                _tune(sock, self.socket_buffer_bytes, self.timeout)
                _send_json(sock, {"model": self.model_key, "hashes": [hashes[i].hex() for i in blocks]}, MAGIC)
                header = _recv_json(sock, deadline)
                if "error" in header:
                    raise TransferError(f"peer refused: {header['error']}")
                layout = BlockLayout.from_header(header)
                if self.layout is not None and layout != self.layout:
                    raise TransferError(f"peer's blocks are {layout}, this replica's {self.layout}")
                raw, block_bytes = landing.claim(layout), layout.num_bytes
                got = 0
                while (n := _LEN.unpack(_recv_exact(sock, 4, deadline))[0]) > 0:
                    if got + n > len(blocks):
                        raise TransferError("peer sent more blocks than asked for")
                    if abort.is_set():
                        raise _Aborted("another stripe failed")
                    sums = list(struct.unpack(f">{n}Q", _recv_exact(sock, 8 * n, deadline)))
                    at = (blocks.start + got) * block_bytes
                    frame = raw[at : at + n * block_bytes]
                    _recv_into(sock, frame, deadline)
                    if _checksums(frame, block_bytes) != sums:
                        raise TransferError(f"checksum mismatch in blocks from {addr[0]}:{addr[1]}")
                    got += n
                return got
        except BaseException:
            abort.set()
            raise
