"""Peer-to-peer KV block transfer over TCP.

Wire format (one request per connection round, big-endian lengths):
  request:  b"DSKV" u32 len, JSON {"model": key, "hashes": [hex, ...]}
  response: u32 len, JSON {"num_blocks": k, "block_bytes": n, "dtype": str, "block_shape": [...],
            "checksums": [xxh3_64 per block]}, then k * n raw bytes
The server answers with the longest run of leading blocks it still holds (possibly none). Bytes go
from the cache gather straight to the socket and from the socket into one preallocated buffer.
"""

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"DSKV"
_LEN = struct.Struct(">I")
_CHUNK = 1 << 22  # recv_into granularity

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransferError(Exception):
    """A pull failed (peer gone, timeout, protocol or checksum error): the caller recomputes."""


@dataclass
class ExportedBlocks:
    data: torch.Tensor  # [k, *block_shape] on the host, contiguous
    hashes: list[bytes]


@dataclass
class PulledBlocks:
    data: torch.Tensor  # [k, *block_shape]
    num_bytes: int
    seconds: float


def block_checksums(data: torch.Tensor) -> list[int]:
    raw = data.contiguous().view(torch.uint8).view(data.shape[0], -1).numpy()
    return [xxhash.xxh3_64_intdigest(memoryview(row)) for row in raw]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got : got + _CHUNK])
        if n == 0:
            raise TransferError("peer closed the connection mid-transfer")
        got += n


def _send_json(sock: socket.socket, obj: dict, magic: bytes = b"") -> None:
    body = json.dumps(obj).encode()
    sock.sendall(magic + _LEN.pack(len(body)) + body)


def _recv_json(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > 64 << 20:
        raise TransferError(f"oversized header ({n} bytes)")
    return json.loads(_recv_exact(sock, n))


class KVTransferServer:
    """Serves this replica's cached blocks to peers; `export(hashes)` runs on the server's threads."""

    def __init__(self, host: str, port: int, model_key: str, export: Callable[[list[bytes]], ExportedBlocks]):
        self.model_key = model_key
        self.export = export
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-transfer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                magic = sock.recv(4, socket.MSG_WAITALL)
                if not magic:
                    return
                if magic != MAGIC:
                    return
                req = _recv_json(sock)
                if req.get("model") != self.model_key:
                    _send_json(sock, {"num_blocks": 0, "error": "model mismatch"})
                    continue
                blocks = self.export([bytes.fromhex(h) for h in req.get("hashes", [])])
                data = blocks.data
                k = data.shape[0]
                header = {"num_blocks": k, "block_bytes": data[0].numel() * data.element_size() if k else 0,
                          "dtype": str(data.dtype).removeprefix("torch."), "block_shape": list(data.shape[1:]),
                          "checksums": block_checksums(data) if k else []}
                _send_json(sock, header)
                if k:
                    sock.sendall(memoryview(data.view(torch.uint8).numpy()).cast("B"))
        except (OSError, TransferError, ValueError) as e:
            logger.debug("KV transfer connection ended: %s", e)


class TcpTransport:
    """Pulls blocks from a peer's KVTransferServer."""

    name = "tcp"

    def __init__(self, model_key: str, timeout: float = 5.0):
        self.model_key = model_key
        self.timeout = timeout

    def pull(self, addr: str, hashes: list[bytes]) -> PulledBlocks:
        host, _, port = addr.rpartition(":")
        start = time.perf_counter()
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _send_json(sock, {"model": self.model_key, "hashes": [h.hex() for h in hashes]}, MAGIC)
                header = _recv_json(sock)
                k = int(header.get("num_blocks", 0))
                if k == 0:
                    raise TransferError(header.get("error", "peer holds none of the blocks any more"))
                if k > len(hashes):
                    raise TransferError("peer sent more blocks than asked for")
                dtype = _DTYPES[header["dtype"]]
                shape = [k, *header["block_shape"]]
                data = torch.empty(shape, dtype=dtype)
                raw = data.view(torch.uint8).numpy()
                if raw.nbytes != k * header["block_bytes"]:
                    raise TransferError("block size disagrees with its shape")
                _recv_into(sock, memoryview(raw).cast("B"))
        except (OSError, ValueError, KeyError) as e:
            raise TransferError(f"pull from {addr} failed: {e}") from e
        if block_checksums(data) != header["checksums"]:
            raise TransferError(f"checksum mismatch in blocks from {addr}")
        return PulledBlocks(data, raw.nbytes, time.perf_counter() - start)
