"""A dead member's work on the second shared tier was dropped when the first tier's failed.

b's heartbeat is handed a dead member's unfinished work on every shared tier at once (the
keys already evicting in b's set) and removes it tier by tier. When the removal on the first
tier failed (here the lookup index could not be told, for a moment), the exception ended
the loop: the keys handed over on the other tier were never deleted nor remembered, and
stayed evicting in b's set while b lived: bytes counted for good, the chunks busy to every
writer. Real Redis, a PFS directory."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from cluster_faults import quick_reaping  # noqa: E402
from faults import unlisting_fails_once, wait_until  # noqa: E402
from kvstore.cluster.ledger import Ledger  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import daemon_config  # noqa: E402

KEY, BLOB = b"\x7c" * 32, 4224


def test_a_dead_members_work_on_every_tier_is_finished_when_one_tiers_removal_fails(tmp_path, redis_server):
    cfg = quick_reaping(daemon_config(tmp_path, "b", redis_server.url, True, "rv-reap-two", pfs=True))
    cfg.cluster.enabled, cfg.cluster.member = True, "b"
    with Store(cfg) as b:
        failed = unlisting_fails_once(b.shared_index)
        budgets = {"pfs": cfg.pfs.capacity_bytes, "redis": cfg.redis.capacity_bytes}
        d = Ledger(redis_server.url, cfg.shared_index.key_prefix, False)
        try:  # d reserves the chunk on both tiers and dies before writing either
            d.join("d", budgets, {})
            for tier in budgets:
                assert d.reserve("d", tier, KEY, BLOB, BLOB, 10.0)[0] == "ok"
        finally:
            d.close()
        ledger = b.cluster.ledger

        def finished():
            state = ledger.state(10.0)
            return all(ledger.holder(t, KEY) is None and state.tiers[t].in_flight == 0 for t in budgets)
        wait_until(finished, timeout_s=5, what="b to finish d's unfinished writes on both tiers")
        assert failed, "the removal on the first tier did not fail"
