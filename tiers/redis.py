"""Redis tier: each value is one Redis string under ``key_prefix + key.hex()``.

Redis is shared by every daemon and may evict values on its own (maxmemory policies), so
this tier's index is only a view: what this process wrote, read, or found by ``keys()``.
A value that vanished is a clean miss (``read_into`` returns None and the view forgets it);
a key missing from the view costs one STRLEN, so values written by other daemons are found.
``used_bytes`` sums the view's value lengths (Redis's own per-key overhead is not counted);
``capacity_bytes`` is this daemon's budget against that view, not the server's memory.

Works against a standalone server or a Redis Cluster (``cluster=True``; pipelines are
split per node by the client). Every call has socket timeouts and at most one quick retry
on a fresh connection, so a server that is down raises ``TierUnavailable`` promptly, and
the connection pool reconnects by itself when the server is back.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import redis
import redis.exceptions as rex
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from tiers.base import Buffer, Tier, TierError, TierFull, TierUnavailable, as_buffers
from tiers.url import redact_url

# what an unreachable or failing-over server raises
REDIS_DOWN = (rex.ConnectionError, rex.TimeoutError, rex.ClusterError, rex.RedisClusterException)


def connect(
    url: str, cluster: bool, socket_timeout_s: float, connect_timeout_s: float, max_connections: int
) -> redis.Redis | RedisCluster:
    """A pooled client with timeouts and one quick retry, checked with a PING.

    Raises TierUnavailable if the server (or every cluster node) cannot be reached, and
    TierError if it answers but refuses this client (a wrong password, an ACL without
    PING): a configuration error, which waiting for the server does not mend.
    """
    retry = Retry(ExponentialBackoff(cap=0.05, base=0.01), 1)
    common = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s, retry=retry)
    try:
        if cluster:
            client = RedisCluster.from_url(url, max_connections=max_connections, **common)
        else:
            pool = redis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=socket_timeout_s, **common
            )
            client = redis.Redis(connection_pool=pool)
        client.ping()
    except (rex.AuthenticationError, rex.ResponseError) as exc:  # the former is a ConnectionError to redis-py
        raise TierError(f"Redis refuses this client (its user, password or ACL): {exc}") from exc
    except REDIS_DOWN as exc:
        raise TierUnavailable(f"cannot reach Redis at {redact_url(url)}: {exc}") from exc
    return client


@contextmanager
def unavailable_on_failure(what: str) -> Iterator[None]:
    """Turn connection failures and timeouts into TierUnavailable, other errors into TierError."""
    try:
        yield
    except rex.OutOfMemoryError as exc:
        raise TierFull(f"{what}: Redis is out of memory: {exc}") from exc
    except REDIS_DOWN as exc:
        raise TierUnavailable(f"{what}: Redis unreachable: {exc}") from exc
    except rex.RedisError as exc:
        raise TierError(f"{what}: Redis error: {exc}") from exc


def _copy_into(data: bytes, out, name: str) -> int:
    outs = [memoryview(o).cast("B") for o in as_buffers(out)]
    capacity = sum(len(o) for o in outs)
    if len(data) > capacity:
        raise ValueError(f"{name}: buffer of {capacity} bytes is too small for {len(data)}")
    done = 0
    for o in outs:
        take = min(len(o), len(data) - done)
        o[:take] = data[done : done + take]
        done += take
    return len(data)


class RedisTier(Tier):
    shared = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        capacity_bytes: int = 1 << 30,
        key_prefix: str = "kvs:",
        cluster: bool = False,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        max_connections: int = 16,
        name: str = "redis",
    ) -> None:
        super().__init__(name, capacity_bytes)
        self.url = url
        self.key_prefix = key_prefix
        self._prefix = key_prefix.encode()
        self._client = connect(url, cluster, socket_timeout_s, connect_timeout_s, max_connections)
        self._sizes: dict[bytes, int] = {}
        self._used = 0
        self._lock = threading.Lock()

    def redis_key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    # -- the view -------------------------------------------------------------------------------

    def _remember(self, key: bytes, size: int) -> None:
        with self._lock:
            self._used += size - self._sizes.get(key, 0)
            self._sizes[key] = size

    def _forget(self, key: bytes) -> bool:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used -= size
            return size is not None

    def _reserve(self, key: bytes, size: int) -> None:
        with self._lock:
            if self._used - self._sizes.get(key, 0) + size > self.capacity_bytes:
                raise TierFull(f"{self.name}: {size} bytes do not fit ({self._used}/{self.capacity_bytes} used)")

    @property
    def used_bytes(self) -> int:
        return self._used

    # -- writes -----------------------------------------------------------------------------------

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        """One SET of the concatenated parts, so readers see the old value or the whole new one."""
        data = b"".join(parts)
        self._reserve(key, len(data))
        with unavailable_on_failure(f"{self.name}: write"):
            self._client.set(self.redis_key(key), data)
        self._remember(key, len(data))

    def write_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> None:
        """``write`` for many values in one pipeline; values written before a failure stay."""
        values = [(key, b"".join(parts)) for key, parts in items]
        with self._lock:
            need = sum(len(v) for _, v in values) - sum(self._sizes.get(k, 0) for k, _ in values)
            if self._used + need > self.capacity_bytes:
                raise TierFull(f"{self.name}: {need} bytes do not fit ({self._used}/{self.capacity_bytes} used)")
        with unavailable_on_failure(f"{self.name}: write_many"):
            pipe = self._client.pipeline(transaction=False)
            for key, value in values:
                pipe.set(self.redis_key(key), value)
            results = pipe.execute(raise_on_error=False)
        error = None
        for (key, value), result in zip(values, results):
            if isinstance(result, Exception):
                error = error or result
            else:
                self._remember(key, len(value))
        if error is not None:
            with unavailable_on_failure(f"{self.name}: write_many"):
                raise error

    # -- reads ------------------------------------------------------------------------------------

    def read(self, key: bytes) -> bytes | None:
        with unavailable_on_failure(f"{self.name}: read"):
            data = self._client.get(self.redis_key(key))
        return self._seen(key, data)

    def _seen(self, key: bytes, data: bytes | None) -> bytes | None:
        if data is None:
            self._forget(key)
        else:
            self._remember(key, len(data))
        return data

    def peek(self, key: bytes, nbytes: int) -> bytes | None:
        """The value's first ``nbytes`` bytes, one GETRANGE (None if absent: no value is empty)."""
        with unavailable_on_failure(f"{self.name}: peek"):
            head = self._client.getrange(self.redis_key(key), 0, nbytes - 1)
        return head or None

    def read_into(self, key: bytes, out) -> int | None:
        """Copy the value into ``out`` (one buffer or a list filled in order); None if absent."""
        data = self.read(key)
        return None if data is None else _copy_into(data, out, self.name)

    def read_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Many GETs in one pipeline (one round trip per node)."""
        with unavailable_on_failure(f"{self.name}: read_many"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self.redis_key(key))
            results = pipe.execute()
        return [self._seen(k, d) for k, d in zip(keys, results)]

    def read_many_into(self, keys: Sequence[bytes], outs: Sequence) -> list[int | None]:
        return [None if d is None else _copy_into(d, o, self.name) for d, o in zip(self.read_many(keys), outs)]

    # -- the rest of the interface -------------------------------------------------------------------

    def delete(self, key: bytes) -> bool:
        """Forget the value, then delete it from Redis. If Redis is unreachable the value may
        outlive the delete; it is still the right bytes for its key (keys name content)."""
        known = self._forget(key)
        with unavailable_on_failure(f"{self.name}: delete"):
            removed = self._client.delete(self.redis_key(key))
        return known or bool(removed)

    def size_of(self, key: bytes) -> int | None:
        """The view's size, or one STRLEN when the view does not know the key."""
        size = self._sizes.get(key)
        if size is not None:
            return size
        with unavailable_on_failure(f"{self.name}: size_of"):
            size = self._client.strlen(self.redis_key(key))
        if not size:
            return None
        self._remember(key, size)
        return size

    def contains(self, key: bytes) -> bool:
        return self.size_of(key) is not None

    def keys(self) -> Iterator[bytes]:
        """Every value under this prefix on the server (SCAN, then pipelined STRLEN); the view
        is refreshed with what is found."""
        pattern = _glob_escape(self._prefix) + b"*"
        with unavailable_on_failure(f"{self.name}: keys"):
            found = []
            for rkey in self._client.scan_iter(match=pattern, count=1000):
                try:
                    found.append(bytes.fromhex(rkey[len(self._prefix) :].decode()))
                except ValueError:
                    continue  # not one of ours (another prefix that extends this one)
            pipe = self._client.pipeline(transaction=False)
            for key in found:
                pipe.strlen(self.redis_key(key))
            sizes = pipe.execute() if found else []
        present = []
        for key, size in zip(found, sizes):
            if size:
                self._remember(key, size)
                present.append(key)
        return iter(present)

    def __len__(self) -> int:
        return len(self._sizes)

    def close(self) -> None:
        self._client.close()


def _glob_escape(pattern: bytes) -> bytes:
    out = bytearray()
    for b in pattern:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)
