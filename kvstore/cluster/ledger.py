"""The cluster ledger: what every daemon sharing the pfs and redis tiers must agree on, kept
in the shared index's Redis (docs/cluster.md).

Per shared tier: its budget, the bytes used against it (in total and per member), and one
entry per chunk on it (state, footprint, size, owner). Per member: a heartbeat and its pins,
each with an expiry. Every change is one Lua script, so it is atomic, and the scripts use
the server's clock, so members need no synchronised clocks.

Why one hash slot: a check and its update ("does this fit the budget? then count it") must
be one atomic step, and a Redis Cluster runs a script only on keys of one slot. Every key
here carries the hash tag ``{<prefix>cluster}``: the ledger lives on one primary (and its
replicas) while the per-chunk lookup index stays spread over all nodes.

A chunk entry's states: ``p`` (pending: its owner writes it now), ``r`` (resident:
written, counted, a candidate for eviction in its owner's FIFO), ``e`` (evicting: a member
deletes its value now). Bytes count from the reservation until the value is gone, so the
values on a tier never take more than its budget. A member silent for ``member_ttl_s`` is
dead: its pins stop counting at once, and its unfinished writes and deletes are finished
(their values removed) by whichever member reaps it.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tiers.redis import REDIS_DOWN, connect, unavailable_on_failure

_LUA = Path(__file__).with_name("lua")

_SCRIPTS = ("join", "beat", "leave", "reserve", "commit", "release", "deleting", "undoing", "evicted",
            "mine_to_delete", "make_room", "room_victims", "pin", "now")


def _script(name: str) -> str:
    """One script's Lua (``lua/<name>.lua``, each with its ARGV and reply at its top) after
    the helpers every script shares (``lua/common.lua``)."""
    return (_LUA / "common.lua").read_text() + (_LUA / f"{name}.lua").read_text()


class BudgetMismatch(ValueError):
    """This daemon's budget for a shared tier is not the cluster's."""


@dataclass
class TierUsage:
    budget_bytes: int
    used_bytes: int
    chunks: int
    by_member: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0


@dataclass
class MemberState:
    name: str
    heartbeat_age_s: float | None  # None: left cleanly
    live: bool
    pins: int
    info: dict


@dataclass
class ClusterState:
    tiers: dict[str, TierUsage]
    members: list[MemberState]


class Ledger:
    """The scripts in ``lua/``, bound to one Redis (standalone or Cluster) and one key prefix."""

    def __init__(self, url: str, key_prefix: str, cluster: bool, socket_timeout_s: float = 1.0,
                 connect_timeout_s: float = 0.5, max_connections: int = 8) -> None:
        self.prefix = "{" + key_prefix + "cluster}:"
        self._cluster = cluster
        self._tag = self.prefix + "tag"  # routes every script to the ledger's slot
        self._client = connect(url, cluster, socket_timeout_s, connect_timeout_s, max_connections)
        self._scripts = {name: self._client.register_script(_script(name)) for name in _SCRIPTS}

    def _call(self, name: str, *args) -> object:
        with unavailable_on_failure(f"cluster ledger: {name}"):
            return self._scripts[name](keys=[self._tag], args=[self.prefix, *args])

    @staticmethod
    def _str(value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def _pairs(self, answer) -> list[tuple[str, bytes]]:
        """``'tier keyhex'`` strings as (tier, key id)."""
        out = []
        for item in answer:
            tier, key = self._str(item).split(" ")
            out.append((tier, bytes.fromhex(key)))
        return out

    # -- membership ------------------------------------------------------------------------------

    def join(self, member: str, budgets: dict[str, int], info: dict) -> list[tuple[str, bytes]]:
        """Become a member; raises BudgetMismatch if a budget differs from the cluster's.
        Returns the (tier, key) values this member's previous run left half-written."""
        args = [member, json.dumps(info)]
        for tier, budget in budgets.items():
            args += [tier, str(int(budget))]
        answer = self._call("join", *args)
        if self._str(answer[0]) == "budget":
            raise BudgetMismatch(f"{self._str(answer[1])}.capacity_bytes is {budgets[self._str(answer[1])]} bytes "
                                 f"but the cluster's budget for it is {self._str(answer[2])}; every member of a "
                                 f"cluster must configure the same budget (see docs/cluster.md)")
        return self._pairs(answer[1:])

    def beat(self, member: str, info: dict, member_ttl_s: float, forget_after_s: float,
             token: str | None = None, tiers: Sequence[str] = ()) -> list[tuple[str, bytes]]:
        """A heartbeat; returns the (tier, key) values of dead members this member must delete,
        on ``tiers`` (the tiers it mounts; none: every tier). ``token`` names the call: a beat
        after one that failed passes that one's token, so that what it may have handed over is
        answered again rather than lost (``lua/beat.lua``)."""
        answer = self._call("beat", member, json.dumps(info), int(member_ttl_s * 1000), int(forget_after_s * 1000),
                            token or secrets.token_hex(12), *tiers)
        return self._pairs(answer)

    def leave(self, member: str, info: dict) -> None:
        self._call("leave", member, json.dumps({**info, "left": True}))

    # -- the budget -------------------------------------------------------------------------------

    def reserve(self, member: str, tier: str, key_id: bytes, footprint: int, size: int,
                member_ttl_s: float, take: bool = False) -> tuple[str, int]:
        """``take``: the value the ledger lists as resident is gone from the medium; reserve
        it again rather than answer "present"."""
        answer = self._call("reserve", member, tier, key_id.hex(), footprint, size, int(member_ttl_s * 1000),
                            "1" if take else "0")
        return self._str(answer[0]), int(answer[1])

    def holder(self, tier: str, key_id: bytes) -> tuple[str, str] | None:
        """The chunk's entry now: (state, owner), or None if the ledger has none."""
        with unavailable_on_failure("cluster ledger: holder"):
            v = self._client.hget(self.prefix + "t:" + tier, key_id.hex())
        if v is None:
            return None
        state, _, _, owner = self._str(v).split(" ", 3)
        return state, owner

    def commit(self, member: str, tier: str, key_id: bytes) -> bool:
        return bool(self._call("commit", member, tier, key_id.hex()))

    def release(self, member: str, tier: str, key_ids: Sequence[bytes], own_only: bool = False) -> int:
        return int(self._call("release", member, tier, "1" if own_only else "0", *[k.hex() for k in key_ids]))

    def deleting(self, member: str, tier: str, key_ids: Sequence[bytes]) -> int:
        return int(self._call("deleting", member, tier, *[k.hex() for k in key_ids]))

    def undoing(self, member: str, tier: str, key_id: bytes, token: str) -> str:
        """Take the key's entry to undo this member's uncommitted write of it: 'mine', 'kept' or
        'busy' (``lua/undoing.lua``). ``token`` names the undo: the same for every retry of it."""
        return self._str(self._call("undoing", member, tier, key_id.hex(), token))

    def evicted(self, member: str, tier: str, key_ids: Sequence[bytes]) -> int:
        return int(self._call("evicted", member, tier, *[k.hex() for k in key_ids]))

    def mine_to_delete(self, member: str, tier: str, key_ids: Sequence[bytes]) -> list[bytes]:
        """Those of ``key_ids`` that are still this member's to delete (marked evicting by it)."""
        if not key_ids:
            return []
        answer = self._call("mine_to_delete", member, tier, *[k.hex() for k in key_ids])
        return [bytes.fromhex(self._str(k)) for k in answer]

    def make_room(self, member: str, tier: str, need: int, member_ttl_s: float, token: str,
                  max_victims: int = 256) -> tuple[str, int, list[bytes]]:
        """``token`` names this call (a fresh one each), so that a retry of it answers the same
        victims, and they can be asked for if its reply is lost (``room_victims``)."""
        answer = self._call("make_room", member, tier, need, int(member_ttl_s * 1000), max_victims, token)
        return self._str(answer[0]), int(answer[1]), [bytes.fromhex(self._str(k)) for k in answer[2:]]

    def room_victims(self, token: str) -> list[bytes]:
        """The victims of the make_room call named ``token`` whose reply was lost (none if it
        did not run, or answered without victims)."""
        return [bytes.fromhex(self._str(k)) for k in self._call("room_victims", token)]

    # -- pins --------------------------------------------------------------------------------------

    def pin(self, member: str, key_ids: Sequence[bytes], ttl_s: float) -> None:
        if key_ids:
            self._call("pin", member, int(ttl_s * 1000), *[k.hex() for k in key_ids])

    def unpin(self, member: str, key_ids: Sequence[bytes]) -> None:
        if key_ids:
            with unavailable_on_failure("cluster ledger: unpin"):
                self._client.zrem(self.prefix + "pins:" + member, *[k.hex() for k in key_ids])

    # -- reading it all (``kvstore cluster``) ---------------------------------------------------------

    def state(self, member_ttl_s: float) -> ClusterState:
        with unavailable_on_failure("cluster ledger: state"):
            c, p = self._client, self.prefix
            now_ms = int(self._call("now"))  # the ledger node's clock, which the scripts use
            budgets = {self._str(k): int(v) for k, v in c.hgetall(p + "budget").items()}
            used = {self._str(k): int(v) for k, v in c.hgetall(p + "used").items()}
            beats = {self._str(m): s for m, s in c.zrange(p + "beats", 0, -1, withscores=True)}
            infos = {self._str(k): json.loads(v) for k, v in c.hgetall(p + "info").items()}
            tiers = {}
            for tier, budget in budgets.items():
                by_member = {self._str(k): int(v) for k, v in c.hgetall(p + "u:" + tier).items()}
                in_flight = sum(c.scard(f"{p}f:{tier}:{m}") for m in set(beats) | set(by_member))
                tiers[tier] = TierUsage(budget, used.get(tier, 0), c.hlen(p + "t:" + tier), by_member, in_flight)
            members = []
            for name in sorted(set(beats) | set(infos)):
                info = infos.get(name, {})
                beat = beats.get(name)
                age = None if beat is None or info.get("left") else (now_ms - beat) / 1000
                live = age is not None and age <= member_ttl_s
                pins = c.zcount(p + "pins:" + name, now_ms + 1, "+inf") if live else 0
                members.append(MemberState(name, age, live, pins, info))
        return ClusterState(tiers, members)

    def health(self) -> dict:
        """The Redis side: ``{"redis": "ok"}`` for a standalone server; for a Redis Cluster its
        state, live primaries and replicas, failed nodes, and primaries with no live replica
        (one more failure there loses slots)."""
        with unavailable_on_failure("cluster ledger: health"):
            if not self._cluster:
                self._client.ping()
                return {"redis": "ok"}
            state, nodes = self._ask_any_node()
        flags = {addr: set(n["flags"].split(",")) for addr, n in nodes.items()}
        up = {addr for addr, f in flags.items() if not f & {"fail", "fail?", "noaddr"}}
        primaries = {n["node_id"]: addr for addr, n in nodes.items() if "master" in flags[addr] and addr in up and n["slots"]}
        covered = {n["master_id"] for addr, n in nodes.items() if "slave" in flags[addr] and addr in up}
        return {"redis": state, "primaries": len(primaries),
                "replicas": sum(1 for a in up if "slave" in flags[a]),
                "failed": sorted(set(nodes) - up),
                "primaries_without_replica": sorted(a for i, a in primaries.items() if i not in covered)}

    def _ask_any_node(self) -> tuple[str, dict]:
        """CLUSTER INFO and CLUSTER NODES from the first node that answers (a failed node
        cannot say the cluster's state)."""
        error = None
        for node in self._client.get_nodes():
            try:
                info = self._client.cluster_info(target_nodes=node)
                nodes = self._client.execute_command("CLUSTER NODES", target_nodes=node)
                return info.get("cluster_state", "unknown"), nodes
            except REDIS_DOWN as exc:
                error = exc
        raise error

    def close(self) -> None:
        self._client.close()
