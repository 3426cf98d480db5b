"""The shared index: which chunks exist in which shared tier (pfs, redis), kept in Redis so
that a lookup on any daemon sees chunks that any daemon wrote, without scanning a file
system or asking each tier.

Layout: one Redis hash per chunk, ``key_prefix + key_id.hex()``, field = tier name, value =
stored size in bytes. One hash per chunk spreads the index over every node of a Redis
Cluster, and needs no cross-slot command: batches are pipelines of per-key commands (one
round trip per node). The index is a hint, not the truth: a tier may have lost a value
since (Redis evicting, another daemon deleting a file), so a reader that misses in a tier
calls ``remove`` for it and goes on. Redis unreachable raises ``TierUnavailable`` (after
socket timeouts); callers then fall back to their local index.
"""

from __future__ import annotations

from typing import Sequence

from tiers.redis import connect, unavailable_on_failure


class SharedIndex:
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "kvs:idx:",
        cluster: bool = False,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        max_connections: int = 8,
    ) -> None:
        self.key_prefix = key_prefix
        self._prefix = key_prefix.encode()
        self._client = connect(url, cluster, socket_timeout_s, connect_timeout_s, max_connections)

    def _key(self, key_id: bytes) -> bytes:
        return self._prefix + key_id.hex().encode()

    def _run(self, what: str, commands) -> list:
        """Queue ``commands(pipe)`` on one non-transactional pipeline and execute it."""
        with unavailable_on_failure(f"shared index: {what}"):
            pipe = self._client.pipeline(transaction=False)
            commands(pipe)
            return pipe.execute()

    def add(self, tier_name: str, key_ids: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Record that ``tier_name`` holds each chunk with the given stored size."""
        if len(key_ids) != len(sizes):
            raise ValueError(f"{len(key_ids)} key ids but {len(sizes)} sizes")
        if key_ids:
            self._run("add", lambda p: [p.hset(self._key(k), tier_name, int(s)) for k, s in zip(key_ids, sizes)])

    def remove(self, tier_name: str, key_ids: Sequence[bytes]) -> None:
        """Forget ``tier_name``'s copies; a chunk with no copy left disappears from the index."""
        if key_ids:
            self._run("remove", lambda p: [p.hdel(self._key(k), tier_name) for k in key_ids])

    def lookup(self, key_ids: Sequence[bytes]) -> dict[bytes, dict[str, int]]:
        """``{key_id: {tier_name: size}}`` for the chunks some shared tier holds (absent ones left out)."""
        if not key_ids:
            return {}
        found = self._run("lookup", lambda p: [p.hgetall(self._key(k)) for k in key_ids])
        return {
            k: {name.decode(): int(size) for name, size in fields.items()}
            for k, fields in zip(key_ids, found)
            if fields
        }

    def longest_prefix(self, key_ids: Sequence[bytes]) -> int:
        """How many leading chunks some shared tier holds (one batched EXISTS per key)."""
        if not key_ids:
            return 0
        exists = self._run("longest_prefix", lambda p: [p.exists(self._key(k)) for k in key_ids])
        for i, present in enumerate(exists):
            if not present:
                return i
        return len(key_ids)

    def close(self) -> None:
        self._client.close()
