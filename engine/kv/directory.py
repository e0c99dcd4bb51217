"""The KV directory in Redis: which live replica holds which prefix block.

Keys (all under `dsf:<model key>:`):
  replica:<id>   hash {incarnation, addr, transport, sig}, expiring unless the replica's heartbeat renews
                 it; sig is the fleet secret's MAC over the other fields (engine.kv.auth), checked before
                 a pull, so a Redis writer without the secret cannot point a replica at a peer of its own
  block:<hash>   hash {<replica id>: <incarnation>}, expiring `entry_ttl` after the last publish

An entry is trusted only while its replica's heartbeat key exists with the same incarnation, so a
dead replica's entries die with its heartbeat and a restarted replica's old entries are ignored.
Writes are batched on a background thread; a lookup is one round trip (a Lua script). Redis being
down never fails a request: publishing retries, lookups answer "nothing".
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass

import redis

from engine.kv.auth import PeerAuth

logger = logging.getLogger(__name__)

# KEYS: block keys in prefix order. ARGV: replica key prefix, own replica id.
# Returns {replica id, addr, transport, number of leading blocks, incarnation, sig} for the live peer
# holding the longest run of leading blocks, or {} when none does.
_LOOKUP = """
local prefix, me = ARGV[1], ARGV[2]
local alive = {}
local function live(rid, inc)
  if alive[rid] == nil then
    local info = redis.call('HMGET', prefix .. rid, 'incarnation', 'addr', 'transport', 'sig')
    alive[rid] = info
  end
  local info = alive[rid]
  return info[1] ~= false and info[1] == inc
end
local holders = nil
local best, best_n = nil, 0
for i, key in ipairs(KEYS) do
  local flat = redis.call('HGETALL', key)
  local now = {}
  local any = false
  for j = 1, #flat, 2 do
    local rid, inc = flat[j], flat[j + 1]
    if rid ~= me and (holders == nil or holders[rid]) and live(rid, inc) then
      now[rid] = true
      any = true
      best, best_n = rid, i
    end
  end
  if not any then break end
  holders = now
end
if best == nil then return {} end
local info = alive[best]
return {best, info[2], info[3], best_n, info[1], info[4]}
"""


@dataclass(frozen=True)
class PeerPrefix:
    replica_id: str
    addr: str  # host:port of its KV transfer server
    transport: str
    num_blocks: int  # leading blocks of the asked-for run it holds


class KVDirectory:
    def __init__(self, url: str, model_key: str, replica_id: str, incarnation: str, addr: str, transport: str = "tcp",
                 heartbeat_ttl: float = 15.0, entry_ttl: float = 600.0, timeout: float = 0.5,
                 auth: PeerAuth | None = None):
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.auth = auth or PeerAuth(None)
        self.num_forged = 0  # lookups that found a replica record the fleet's secret did not sign
        self.ns = f"dsf:{model_key}:"
        self.replica_id, self.incarnation, self.addr, self.transport = replica_id, incarnation, addr, transport
        self.heartbeat_ttl, self.entry_ttl = heartbeat_ttl, entry_ttl
        self._lookup = self.client.register_script(_LOOKUP)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.healthy = True
        self.num_errors = 0
        self._registered = False
        self._thread = threading.Thread(target=self._run, name="kv-directory", daemon=True)

    def _block_key(self, h: bytes) -> str:
        return f"{self.ns}block:{h.hex()}"

    def _replica_key(self, rid: str) -> str:
        return f"{self.ns}replica:{rid}"

    # -- engine side: never blocks ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def publish(self, hashes: list[bytes]) -> None:
        if hashes:
            self._queue.put(("add", hashes))

    def unpublish(self, hashes: list[bytes]) -> None:
        if hashes:
            self._queue.put(("remove", hashes))

    # -- request side: one round trip ---------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> PeerPrefix | None:
        """The live peer holding the longest run of these leading blocks (None when none or Redis is down)."""
        if not hashes:
            return None
        try:
            res = self._lookup(keys=[self._block_key(h) for h in hashes],
                               args=[self._replica_key(""), self.replica_id])
        except redis.RedisError as e:
            self._error("lookup", e)
            return None
        if not res:
            return None
        # whatever a Redis writer put there: fields of any type, any bytes
        rid, addr, transport, n, incarnation, sig = (
            (v.decode(errors="replace") if isinstance(v, bytes) else v) for v in (list(res) + [None] * 6)[:6])
        transport = transport or "tcp"
        fields = (rid, incarnation, addr, transport)
        if (not all(isinstance(f, str) for f in fields) or not isinstance(n, int)
                or not self.auth.verify(sig if isinstance(sig, str) else "", *fields)):
            self.num_forged += 1
            logger.warning("KV directory: replica %r's record is not signed with this fleet's secret; ignored", rid)
            return None
        return PeerPrefix(rid, addr, transport, n)

    # -- background thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + (self.heartbeat_ttl / 3 if self._beat() else 1.0)
            try:
                item = self._queue.get(timeout=max(0.05, next_beat - time.monotonic()))
            except queue.Empty:
                continue
            if item is None:
                break
            batch = [item]
            while len(batch) < 256:  # drain what queued up meanwhile into one pipeline
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._stop.set()
                    break
                batch.append(nxt)
            self._write(batch)

    def _beat(self) -> bool:
        """Renew the heartbeat key's TTL; (re)write it only when it is missing (first beat, Redis restart)."""
        try:
            key = self._replica_key(self.replica_id)
            ttl = max(1, int(self.heartbeat_ttl))
            if not self.client.expire(key, ttl) or not self._registered:
                pipe = self.client.pipeline(transaction=True)
                sig = self.auth.sign(self.replica_id, self.incarnation, self.addr, self.transport)
                pipe.hset(key, mapping={"incarnation": self.incarnation, "addr": self.addr, "transport": self.transport,
                                        "sig": sig})
                pipe.expire(key, ttl)
                pipe.execute()
                self._registered = True
            self._recovered()
            return True
        except redis.RedisError as e:
            self._error("heartbeat", e)
            return False

    def _write(self, batch: list[tuple[str, list[bytes]]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for op, hashes in batch:
            for h in hashes:
                key = self._block_key(h)
                if op == "add":
                    pipe.hset(key, self.replica_id, self.incarnation)
                    pipe.expire(key, int(self.entry_ttl))
                else:
                    pipe.hdel(key, self.replica_id)
        try:
            pipe.execute()
            self._recovered()
        except redis.RedisError as e:
            # entries are soft state: dropping a batch only costs cache hits, never correctness
            self._error("publish", e)

    def _error(self, what: str, e: Exception) -> None:
        self.num_errors += 1
        if self.healthy:
            logger.warning("KV directory unreachable (%s failed: %s); serving from the local cache", what, e)
        self.healthy = False

    def _recovered(self) -> None:
        if not self.healthy:
            logger.info("KV directory reachable again")
        self.healthy = True

    def close_replica(self) -> None:
        """Remove this replica's heartbeat now (a clean shutdown), so peers stop asking it."""
        try:
            self.client.delete(self._replica_key(self.replica_id))
        except redis.RedisError:
            pass
