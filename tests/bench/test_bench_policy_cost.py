"""``kvbench policy-cost`` splits the Store's time into the policy's own calls (logged, then
replayed against a fresh policy) and the rest; the split is only right if the replay makes
the same decisions the logged run did."""

from bench.policy_cost import RecordingPolicy, replay_seconds, store_seconds
from bench.sim import capacity_blocks, simulate
from bench.traces import load_trace
from kvstore.policies import make_policy


class KeepsVictims(RecordingPolicy):
    victims: list

    def evict(self):
        victim = super().evict()
        self.victims.append(victim)
        return victim


def test_a_replayed_call_log_makes_the_same_decisions():
    trace = load_trace("workload:saas:requests=300")
    blocks = capacity_blocks(trace, 5)
    recorder = KeepsVictims(make_policy("shadow-vote", blocks))
    recorder.victims = []
    simulate(trace, recorder, blocks)
    assert recorder.victims  # the run evicted, so there are decisions to compare
    fresh = make_policy("shadow-vote", blocks)
    replayed = [fresh.evict() if name == "evict" else getattr(fresh, name)(*args) for name, args in recorder.calls]
    assert [v for (name, _), v in zip(recorder.calls, replayed) if name == "evict"] == recorder.victims
    assert replay_seconds("shadow-vote", blocks, recorder.calls) > 0


def test_store_seconds_gives_the_policys_share_of_the_store_time():
    trace = load_trace("workload:chat:requests=80")
    total, policy = store_seconds(trace, "shadow-vote", capacity_blocks(trace, 10))
    assert 0 < policy < total
