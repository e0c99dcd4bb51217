"""Peers of one fleet prove to each other that they hold the fleet's secret before any hash or block moves,
and sign what they write to the directory with it.

Handshake, client first, right after connect (before the transfer protocol's own magic):
  client -> server: b"DSKA" + 16-byte client nonce
  server -> client: 16-byte server nonce + HMAC-SHA256(secret, b"server" + client nonce + server nonce)
  client -> server: HMAC-SHA256(secret, b"client" + server nonce + client nonce)
Each side checks the other's MAC in constant time and hangs up on a mismatch, so a peer without the
secret learns nothing and serves nothing, and a fake peer cannot pass as a replica. Both nonces are
fresh, so a recorded exchange cannot be replayed. Without a secret (a single replica, development) no
handshake happens; a replica with a secret and one without cannot talk, and the puller recomputes.
"""

import hashlib
import hmac
import json
import os
import socket
import time

AUTH_MAGIC = b"DSKA"
NONCE_BYTES = 16
MAC_BYTES = 32


class AuthError(Exception):
    """The peer did not prove it holds the fleet's secret."""


class PeerAuth:
    def __init__(self, secret: bytes | None):
        self.secret = secret or None

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def _mac(self, *parts: bytes) -> bytes:
        return hmac.new(self.secret, b"".join(parts), hashlib.sha256).digest()

    def connect(self, sock: socket.socket, timeout: float = 5.0) -> None:
        """Client side, on a fresh connection; the server has `timeout` seconds in all to answer."""
        if not self.enabled:
            return
        mine = os.urandom(NONCE_BYTES)
        sock.sendall(AUTH_MAGIC + mine)
        reply = _recv(sock, NONCE_BYTES + MAC_BYTES, time.monotonic() + timeout)
        theirs, mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(mac, self._mac(b"server", mine, theirs)):
            raise AuthError("the peer does not hold this fleet's KV secret")
        sock.sendall(self._mac(b"client", theirs, mine))

    def accept(self, sock: socket.socket, timeout: float = 5.0) -> None:
        """Server side, before reading anything else from the connection; the peer has `timeout` seconds
        in all, however it trickles its bytes."""
        if not self.enabled:
            return
        deadline = time.monotonic() + timeout
        hello = _recv(sock, len(AUTH_MAGIC) + NONCE_BYTES, deadline)
        if hello[: len(AUTH_MAGIC)] != AUTH_MAGIC:
            raise AuthError("the peer did not authenticate")
        theirs, mine = hello[len(AUTH_MAGIC) :], os.urandom(NONCE_BYTES)
        sock.sendall(mine + self._mac(b"server", theirs, mine))
        if not hmac.compare_digest(_recv(sock, MAC_BYTES, deadline), self._mac(b"client", mine, theirs)):
            raise AuthError("the peer does not hold this fleet's KV secret")

    def sign(self, *fields: str) -> str:
        """A hex MAC over the fields, JSON-encoded so no two field lists read alike (empty without a secret)."""
        return self._mac(json.dumps(list(fields)).encode()).hex() if self.enabled else ""

    def verify(self, signature: str, *fields: str) -> bool:
        """Constant-time, on bytes: a forged signature of any characters is just wrong, never an error."""
        if not self.enabled:
            return True
        return hmac.compare_digest(signature.encode("utf-8", "replace"), self.sign(*fields).encode())


def _recv(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = b""
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AuthError("the peer is too slow to authenticate")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthError("the peer hung up during the handshake")
        buf += chunk
    return buf


def read_secret(path: str) -> bytes:
    """The fleet secret from a mounted file (surrounding whitespace ignored); at least 16 bytes."""
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"the KV secret in {path} is {len(secret)} bytes; use at least 16 (32 random bytes, say)")
    return secret
