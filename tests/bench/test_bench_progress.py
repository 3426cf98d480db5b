"""Progress lines of long kvbench runs: throttled in time, with elapsed time and an ETA."""

import io

from bench.progress import Progress


def test_progress_says_how_far_and_when_it_ends_at_most_every_few_seconds():
    now = [0.0]
    out = io.StringIO()
    p = Progress(100, "requests replayed", every_s=5.0, out=out, clock=lambda: now[0])
    for _ in range(10):  # 10 units in 1 s: too soon for a line
        now[0] += 0.1
        p.step()
    assert out.getvalue() == ""
    now[0] = 30.0  # 25 units in 30 s: 75 left take 90 s
    p.step(15, what="lru")
    assert out.getvalue() == "  requests replayed lru: 25/100 (25%), 30s elapsed, ETA 1m30s\n"
    now[0] = 30.5
    p.step(75)  # the last step always says so
    assert out.getvalue().splitlines()[-1] == "  requests replayed: 100/100 (100%), 30s elapsed, ETA 0s"
