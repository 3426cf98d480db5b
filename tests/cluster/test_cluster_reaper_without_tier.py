"""A member that does not mount a shared tier took a dead member's work on it, for good.

Members may mount different shared tiers (the cluster needs one, and checks the budgets of
those a member has). ``beat.lua`` reaped a dead member's unfinished work on every tier of the
ledger, moving it into the reaper's set; a reaper without the tier only logged it as "left
to a member with that tier", but no other member was ever handed it: the keys stayed
evicting in the reaper's set while it lived, bytes counted for good, the chunks busy to
every writer. Real Redis, a PFS directory."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from cluster_faults import quick_reaping  # noqa: E402
from faults import wait_until  # noqa: E402
from kvstore.cluster.ledger import Ledger  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import daemon_config  # noqa: E402

KEY, BLOB = b"\x3d" * 32, 4224


def test_a_dead_members_work_on_a_tier_the_reaper_lacks_is_handed_to_a_member_with_it(tmp_path, redis_server):
    cfg = quick_reaping(daemon_config(tmp_path, "p", redis_server.url, True, "rv-reaper-tier", pfs=True))
    cfg.redis.enabled = False  # p mounts the PFS directory only
    cfg.cluster.enabled, cfg.cluster.member = True, "p"
    budgets = {"pfs": cfg.pfs.capacity_bytes, "redis": 1 << 22}
    with Store(cfg) as p:
        d = Ledger(redis_server.url, cfg.shared_index.key_prefix, False)
        try:  # d and x mount both tiers; d reserves the chunk on both and dies before writing it
            d.join("x", budgets, {})
            d.join("d", budgets, {})
            for tier in budgets:
                assert d.reserve("d", tier, KEY, BLOB, BLOB, 10.0)[0] == "ok"
            wait_until(lambda: d.holder("pfs", KEY) is None, what="p to reap d and finish its PFS write")
            handed = d.beat("x", {}, 0.5, 3600.0)  # x is live: its heartbeat reaps what p could not
        finally:
            d.close()
    assert ("redis", KEY) in handed, "d's unfinished Redis write was taken by p, which cannot delete it"
