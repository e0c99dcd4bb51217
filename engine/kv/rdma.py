"""Peer-to-peer KV block pulls as one-sided RDMA reads, on Mooncake's transfer engine (the `rdma` extra).

Each replica registers its KV cache tensors (and a staging buffer for what it pulls) with the engine
once. A pull is one small TCP exchange with the peer's lessor around one batch of RDMA reads:

  puller -> lessor:  b"DSKL" u32 len, JSON {"model": key, "hashes": [hex, ...]}
  lessor -> puller:  u32 len, JSON {"num_blocks": k, "session": "host:port" (the peer's engine),
                     "blocks": [[block id, generation], ...], "block_bytes", "dtype", "block_shape"
                     ([layers, ...]), "regions": [[base address, block stride] per layer],
                     "checksums": [per block]}  (or {"num_blocks": 0, "error": str})
  puller:            reads every block's row of every layer straight out of the peer's cache
  puller -> lessor:  u32 len, JSON {"release": [[block id, generation], ...]}
  lessor -> puller:  u32 len, JSON {"valid": n}  (leading blocks not reused since the lease)

Leases are optimistic: a peer's read never holds up the lessor's own eviction. The release says how
many leading blocks kept their generation through the read; the puller keeps those, checks their
checksums, and a mismatch, a timeout or a dead peer is a TransferError (the caller recomputes).
Connections that do not start with the lease magic are TCP pulls: the lessor passes them through to
the local TCP transfer server, so the one address a replica advertises serves peers of either kind.
"""

import json
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.kv.auth import AuthError, PeerAuth
from engine.kv.transfer import MAX_HASHES, BlockLayout, ConnectionServer, PulledBlocks, TcpTransport, TransferError

logger = logging.getLogger(__name__)

LEASE_MAGIC = b"DSKL"
LESSOR_TIMEOUT = 30.0  # a silent or stalled client is dropped after this long
_LEN = struct.Struct(">I")
_MAX_HEADER = 4 << 20


class RdmaUnavailable(Exception):
    """The RDMA transport cannot run in this process (the message says why); the caller uses TCP."""


@dataclass(frozen=True)
class ServedCache:
    """This replica's KV cache as peers read it, and the address they reach it at."""

    kv_caches: list[torch.Tensor]  # per layer [num_blocks, *block_shape], contiguous, one dtype and shape
    lookup: Callable[[list[bytes]], list[tuple[int, int]]]  # leading hashes held -> (block id, generation)
    still_valid: Callable[[list[tuple[int, int]]], int]  # how many of those pairs were not reused since
    host: str  # the address peers reach this pod at (the pod IP)
    tcp_port: int  # the local TCP transfer server, which takes peers that pull over TCP
    bind_host: str = "0.0.0.0"
    auth: PeerAuth = field(default_factory=lambda: PeerAuth(None))  # the fleet's handshake, both ways

    @property
    def row_bytes(self) -> int:
        """Bytes of one block in one layer."""
        return self.kv_caches[0][0].numel() * self.kv_caches[0].element_size()

    @property
    def layout(self) -> BlockLayout:
        """One pulled block: [layers, *one layer's block shape], contiguous."""
        return BlockLayout((len(self.kv_caches), *self.kv_caches[0].shape[1:]), self.kv_caches[0].dtype)


class BlockChecksum:
    """Per-block checksums computed where the blocks live, with no copy to the host: a polynomial hash of
    a block's signed 16-bit words modulo a prime below 2^21, at three bases (63 bits in all). Each layer's
    row is zero-padded to whole chunks of CHUNK words; a chunk's sum is one float64 matrix product, exact
    because every partial sum stays below 2^53 (CHUNK * 2^15 * 2^21)."""

    PRIME = 2_097_143  # the largest prime below 2^21
    BASES = (5, 11, 17)  # primitive roots of the prime
    CHUNK = 1024  # words per exact dot product
    STEP_BYTES = 16 << 20  # of blocks hashed at once: the float64 words take four times as much

    def __init__(self):
        self._tables: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # by (chunks, device)

    def __call__(self, blocks: torch.Tensor) -> list[int]:
        """[k, layers, ...] -> k checksums."""
        k, num_layers = blocks.shape[:2]
        if k == 0:
            return []
        row_bytes = blocks[0, 0].numel() * blocks.element_size()
        chunks_per_row = -(-row_bytes // (2 * self.CHUNK))
        num_chunks = num_layers * chunks_per_row
        powers, shifts = self._table(num_chunks, blocks.device)
        step = max(1, self.STEP_BYTES // (num_layers * row_bytes))
        sums = []
        for part in blocks.split(step):
            raw = part.reshape(part.shape[0], num_layers, -1).view(torch.uint8)
            if row_bytes % (2 * self.CHUNK):
                raw = F.pad(raw, (0, chunks_per_row * 2 * self.CHUNK - row_bytes))
            words = raw.view(torch.int16).to(torch.float64).view(part.shape[0], num_chunks, self.CHUNK)
            chunk_sums = (words @ powers).to(torch.int64) % self.PRIME  # [n, chunks, bases]
            # chunk c starts c * CHUNK words along: products < 2^42, their sum over < 2^21 chunks < 2^63
            sums.append((chunk_sums * shifts).sum(1) % self.PRIME)
        total = torch.cat(sums)
        return (total[:, 0] << 42 | total[:, 1] << 21 | total[:, 2]).tolist()

    def _table(self, num_chunks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """base^1 .. base^CHUNK ([CHUNK, bases], float64) and base^(c * CHUNK) ([chunks, bases], int64)."""
        key = (num_chunks, str(device))
        if key not in self._tables:
            p = self.PRIME
            powers = [[pow(b, j + 1, p) for b in self.BASES] for j in range(self.CHUNK)]
            shifts = [[pow(b, c * self.CHUNK, p) for b in self.BASES] for c in range(num_chunks)]
            self._tables[key] = (torch.tensor(powers, dtype=torch.float64, device=device),
                                 torch.tensor(shifts, dtype=torch.int64, device=device))
        return self._tables[key]


def _send_json(sock: socket.socket, obj: dict, magic: bytes = b"") -> None:
    body = json.dumps(obj).encode()
    sock.sendall(magic + _LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None if the peer closed the connection before sending any."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if not buf:
                return None
            raise TransferError("peer closed the connection mid-message")
        buf += chunk
    return bytes(buf)


def _recv_json(sock: socket.socket) -> dict | None:
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > _MAX_HEADER:
        raise TransferError(f"oversized message ({n} bytes)")
    body = _recv_exact(sock, n)
    if body is None:
        raise TransferError("peer closed the connection mid-message")
    return json.loads(body)


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Lessor:
    """Answers lease requests for this replica's registered cache; passes TCP pulls through."""

    def __init__(self, cache: ServedCache, model_key: str, session: str, checksum: BlockChecksum):
        self.cache, self.model_key, self.session, self.checksum = cache, model_key, session, checksum
        self._tcp = ConnectionServer(cache.bind_host, 0, self._handle, "kv-lessor", cache.auth)
        self.port = self._tcp.port
        self._tcp.start()

    def stop(self) -> None:
        self._tcp.stop()

    def _handle(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(LESSOR_TIMEOUT)
        try:
            magic = sock.recv(len(LEASE_MAGIC), socket.MSG_PEEK | socket.MSG_WAITALL)
            if magic != LEASE_MAGIC:
                if magic:
                    self._pass_through(sock)
                return
            sock.recv(len(LEASE_MAGIC))
            req = _recv_json(sock)
            if req is None:
                return
            lease = self._lease(req)
            _send_json(sock, lease)
            if lease["num_blocks"]:
                release = _recv_json(sock)
                if release is not None:
                    _send_json(sock, {"valid": self._still_valid(release["release"])})
        except (OSError, TransferError, AuthError, ValueError, KeyError, TypeError) as e:
            logger.debug("KV lease connection ended: %s", e)

    def _lease(self, req: dict) -> dict:
        if req.get("model") != self.model_key:
            return {"num_blocks": 0, "error": "model mismatch"}
        if not isinstance(req.get("hashes"), list) or len(req["hashes"]) > MAX_HASHES:
            return {"num_blocks": 0, "error": f"a lease names at most {MAX_HASHES} blocks"}
        try:
            held = self.cache.lookup([bytes.fromhex(h) for h in req["hashes"]])
            if not held:
                return {"num_blocks": 0, "error": "peer holds none of the blocks any more"}
            caches = self.cache.kv_caches
            ids = torch.tensor([b for b, _ in held], device=caches[0].device)
            blocks = torch.empty(len(held), *self.cache.layout.shape, dtype=caches[0].dtype, device=ids.device)
            for layer, cache in enumerate(caches):
                torch.index_select(cache, 0, ids, out=blocks[:, layer])
            checksums = self.checksum(blocks)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:  # e.g. out of device memory
            return {"num_blocks": 0, "error": f"lease failed: {e}"}
        return {"num_blocks": len(held), "session": self.session, "blocks": held, **self.cache.layout.header(),
                "regions": [[c.data_ptr(), c.stride(0) * c.element_size()] for c in caches],
                "checksums": checksums}

    def _still_valid(self, pairs: list) -> int:
        num_blocks = self.cache.kv_caches[0].shape[0]
        held = [(int(b), int(g)) for b, g in pairs]
        if any(not 0 <= b < num_blocks for b, _ in held):
            raise ValueError("release names a block outside the cache")
        return self.cache.still_valid(held)

    def _pass_through(self, client: socket.socket) -> None:
        """Splice a TCP pull to the local transfer server, byte for byte, both ways."""
        host = "127.0.0.1" if self.cache.bind_host in ("0.0.0.0", "") else self.cache.bind_host
        host = "::1" if host == "::" else host
        with socket.create_connection((host, self.cache.tcp_port)) as backend:
            self.cache.auth.connect(backend)  # the peer proved itself here; this process does the same there
            back = threading.Thread(target=_pump, args=(backend, client), daemon=True)
            back.start()
            _pump(client, backend)
            back.join()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 20):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class RdmaTransport:
    """Pulls blocks from peers' lessors with one-sided reads; serves this replica's blocks the same way."""

    name = "rdma"

    def __init__(self, engine, cache: ServedCache, model_key: str, timeout: float, stats, staging: torch.Tensor):
        self.engine, self.cache, self.model_key, self.timeout, self.stats = engine, cache, model_key, timeout, stats
        self.staging = staging  # registered; pulls take turns on it
        self._staging_lock = threading.Lock()
        self.checksum = BlockChecksum()
        self.session = _join(cache.host, engine.get_rpc_port())
        self.lessor = Lessor(cache, model_key, self.session, self.checksum)
        self.addr = _join(cache.host, self.lessor.port)  # what peers should pull from
        # for peers that do not lease over RDMA
        self.tcp = TcpTransport(model_key, timeout, auth=cache.auth, layout=cache.layout)
        self._tcp_peers: set[str] = set()

    @classmethod
    def open(cls, cache: ServedCache, model_key: str, timeout: float, stats, devices: list[str],
             protocol: str = "rdma", staging_bytes: int = 64 << 20) -> "RdmaTransport":
        """Start Mooncake's engine on `devices` and register the cache; RdmaUnavailable says why not.
        `protocol="tcp"` runs the same path over Mooncake's TCP transport (no RDMA hardware needed)."""
        caches = cache.kv_caches
        if not caches or any(not c.is_contiguous() or c.shape != caches[0].shape or c.dtype != caches[0].dtype
                             for c in caches):
            raise RdmaUnavailable("the KV cache is not one contiguous tensor per layer of one shape and dtype")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # not installed, or a shared library it needs is missing
            raise RdmaUnavailable(f"the mooncake transfer engine cannot be loaded ({e})") from e
        # Mooncake bounds each read by this (plus a second per GiB), read once per engine; its minimum is 5 s
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, math.ceil(timeout))))
        engine = TransferEngine()
        if engine.initialize(cache.host, "P2PHANDSHAKE", protocol, ",".join(devices)) != 0:
            raise RdmaUnavailable(f"Mooncake's transfer engine did not start on {cache.host} ({protocol})")
        if protocol == "rdma" and not _has_hca(engine.get_local_topology()):
            # Mooncake quietly moves data over its own TCP transport when no HCA opens
            raise RdmaUnavailable(f"Mooncake opened none of the RDMA devices {devices}")
        block_bytes = cache.layout.num_bytes
        staging = torch.empty(max(staging_bytes, block_bytes), dtype=torch.uint8, device=caches[0].device)
        regions = [*caches, staging]
        if engine.batch_register_memory([t.data_ptr() for t in regions],
                                        [t.numel() * t.element_size() for t in regions]) != 0:
            raise RdmaUnavailable("registering the KV cache with the RDMA device failed (locked-memory limit: "
                                  "RDMA pods need the IPC_LOCK capability)")
        try:
            return cls(engine, cache, model_key, timeout, stats, staging)
        except OSError as e:  # the lessor's port
            engine.batch_unregister_memory([t.data_ptr() for t in regions])
            raise RdmaUnavailable(f"the KV lessor cannot listen on {cache.bind_host}: {e}") from e

    def close(self) -> None:
        self.lessor.stop()
        self.engine.batch_unregister_memory([t.data_ptr() for t in [*self.cache.kv_caches, self.staging]])

    def pull(self, addr: str, hashes: list[bytes]) -> PulledBlocks:
        start = time.perf_counter()
        try:
            with socket.create_connection(_host_port(addr), timeout=self.timeout) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.cache.auth.connect(sock)
                _send_json(sock, {"model": self.model_key, "hashes": [h.hex() for h in hashes]}, LEASE_MAGIC)
                lease = _recv_json(sock)
                if lease is None:  # a TCP-only peer hangs up on the lease magic
                    return self._pull_over_tcp(addr, hashes)
                k = int(lease.get("num_blocks", 0))
                if k == 0:
                    raise TransferError(lease.get("error", "peer holds none of the blocks any more"))
                data = self._read(lease, k, len(hashes))
                _send_json(sock, {"release": lease["blocks"]})
                reply = _recv_json(sock)
                if reply is None:
                    raise TransferError("peer closed the connection before confirming the lease")
                valid = int(reply["valid"])
        except (OSError, ValueError, KeyError, TypeError, AuthError) as e:
            raise TransferError(f"RDMA pull from {addr} failed: {e}") from e
        if valid == 0:
            raise TransferError(f"{addr} reused the blocks during the read")
        data = data[:valid]
        if self.checksum(data) != lease["checksums"][:valid]:
            raise TransferError(f"checksum mismatch in blocks from {addr}")
        return PulledBlocks(data, data.numel() * data.element_size(), time.perf_counter() - start)

    def _read(self, lease: dict, k: int, num_asked: int) -> torch.Tensor:
        """One-sided reads of the leased blocks -> [k, layers, ...] on the cache's device."""
        layout, num_layers = self.cache.layout, len(self.cache.kv_caches)
        if k > num_asked or len(lease["blocks"]) != k or len(lease["checksums"]) != k:
            raise TransferError("lease disagrees with the request")
        if BlockLayout.from_header(lease) != layout or len(lease["regions"]) != num_layers:
            raise TransferError("peer's cache layout differs from ours")
        row, block_bytes = self.cache.row_bytes, layout.num_bytes
        out = torch.empty(k * block_bytes, dtype=torch.uint8, device=self.staging.device)
        per_round = self.staging.numel() // block_bytes
        base = self.staging.data_ptr()
        with self._staging_lock:
            for first in range(0, k, per_round):
                blocks = lease["blocks"][first : first + per_round]
                n = len(blocks) * num_layers
                local = [base + i * row for i in range(n)]  # [block][layer] rows, as a block is laid out
                remote = [region + int(b) * stride for b, _ in blocks for region, stride in lease["regions"]]
                if self.engine.batch_transfer_sync_read(lease["session"], local, remote, [row] * n) != 0:
                    raise TransferError(f"RDMA read from {lease['session']} failed")
                out[first * block_bytes : (first + len(blocks)) * block_bytes].copy_(self.staging[: n * row])
                if self.staging.is_cuda:  # the next read must not overwrite what the copy still reads
                    torch.cuda.current_stream(self.staging.device).synchronize()
        return layout.view(out, k)

    def _pull_over_tcp(self, addr: str, hashes: list[bytes]) -> PulledBlocks:
        if addr not in self._tcp_peers:
            self._tcp_peers.add(addr)
            logger.info("KV peer %s does not serve RDMA reads; pulling from it over TCP", addr)
        self.stats.fallback("rdma_peer_unavailable")
        return self.tcp.pull(addr, hashes)


def _has_hca(topology: str) -> bool:
    """Mooncake's topology: {"cpu:0": [[preferred HCAs], [other HCAs]], ...}."""
    try:
        return any(any(hcas for hcas in entry) for entry in json.loads(topology).values())
    except (ValueError, TypeError, AttributeError):
        return False
