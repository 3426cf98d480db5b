"""The fault campaign: random operations with injected faults against a real Store, checked
against a reference model after every step (tests/store/store_model.py says what is checked).

CI runs a bounded hypothesis state machine (it shrinks a failure to a short sequence); the
long run is a random walk of ``KVSTORE_FAULT_STEPS`` steps (default one million), outside
CI: ``.venv/bin/python -m pytest -m long tests/store/test_store_faults.py -s`` (``-k placement``
for the walk with placement only). Both run plain and with placement (re-encoded copies,
replicas planned by utility, a disk that fills up).
"""

from __future__ import annotations

import os
import random
import time

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from store_model import CODECS, StoreModel, random_walk

KEYS = 6
key = st.integers(0, KEYS - 1)


class StoreMachine(RuleBasedStateMachine):
    placement = False

    def __init__(self) -> None:
        super().__init__()
        self.model = StoreModel(keys=KEYS, placement=self.placement)

    @rule(i=key, codec=st.sampled_from(CODECS), durable=st.booleans())
    def put(self, i, codec, durable):
        self.model.put(i, codec, durable)

    @rule(i=key, flip=st.booleans())
    def get(self, i, flip):
        self.model.get(i, flip)

    @rule(start=key, data=st.data())
    def get_many(self, start, data):
        self.model.get_many(start, data.draw(st.integers(1, KEYS - start)))

    @rule(start=key, data=st.data())
    def stream(self, start, data):
        count = data.draw(st.integers(1, KEYS - start))
        self.model.stream(start, count, data.draw(st.integers(1, count)))

    @rule(i=key)
    def delete(self, i):
        self.model.delete(i)

    @rule(i=key)
    def drop_host(self, i):
        self.model.drop_host(i)

    @rule(i=key, ttl=st.sampled_from([0.01, 0.1, 10.0]))
    def pin(self, i, ttl):
        self.model.pin(i, ttl)

    @rule(i=key)
    def unpin(self, i):
        self.model.unpin(i)

    @rule()
    def fail_next_write(self):
        self.model.fail_next_write()

    @precondition(lambda self: self.model.hung is None)
    @rule()
    def start_hang(self):
        self.model.start_hang()

    @precondition(lambda self: self.model.hung is not None)
    @rule()
    def end_hang(self):
        self.model.end_hang()

    @rule()
    def flush(self):
        self.model.flush()

    @rule(power_loss=st.booleans(), seed=st.integers(0, 2**16))
    def restart(self, power_loss, seed):
        self.model.restart(power_loss, random.Random(seed))

    @invariant()
    def promises_hold(self):
        self.model.after_step()

    def teardown(self):
        self.model.close()


class PlacedStoreMachine(StoreMachine):
    """The same with placement re-encoding victims and disk copies, replicas planned by
    utility, and a disk that fills up."""

    placement = True


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestPlacedStoreMachine = PlacedStoreMachine.TestCase
TestPlacedStoreMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)


@pytest.mark.long
@pytest.mark.timeout(0)  # runs for as many steps as asked; hours for a million
@pytest.mark.parametrize("placement", [False, True], ids=["plain", "placement"])
def test_a_long_random_walk_breaks_no_promise(placement):
    steps = int(os.environ.get("KVSTORE_FAULT_STEPS", "1000000"))
    seed = int(os.environ.get("KVSTORE_FAULT_SEED", "1"))
    rng = random.Random(seed)
    model = StoreModel(keys=10, seed=seed, placement=placement)
    started = time.monotonic()
    done = 0
    try:
        while done < steps:
            batch = min(10_000, steps - done)
            random_walk(model, batch, rng)
            done += batch
            rate = done / (time.monotonic() - started)
            print(f"{done} steps, {rate:.0f}/s, {model.store.stats().tiers['disk'].corruptions} corrupt replicas dropped",
                  flush=True)
    finally:
        model.close()
    print(f"fault campaign: {done} steps (seed {seed}) in {time.monotonic() - started:.0f} s, no promise broken")
