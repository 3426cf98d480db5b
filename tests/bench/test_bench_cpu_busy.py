"""bench/cpu_busy.py: the machine's and the benchmark's own CPU use over a window, from /proc."""

import subprocess
import sys
import time

import pytest

from bench.cluster import _conditions
from bench.cpu_busy import CpuMeter, CpuSample, _process_ticks, use_between

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_process_name_with_spaces_and_parentheses_is_parsed():
    fields = ["S", "41"] + ["0"] * 9 + ["250", "70", "5", "6"] + ["0"] * 30
    assert _process_ticks("1234 (a) b (c)) " + " ".join(fields)) == (41, 320, 11)


def test_use_is_the_busy_share_of_all_cores():
    first = CpuSample(at=0.0, busy_s=10.0, total_s=20.0, ours_s=1.0)
    last = CpuSample(at=1.0, busy_s=11.9, total_s=22.0, ours_s=2.5)
    use = use_between(first, last)
    assert use.machine == pytest.approx(0.95) and use.saturated
    assert use.ours == pytest.approx(1.5 / use.cores if use.cores > 1 else 1.0)


def test_a_spinning_child_is_counted_as_ours_also_after_it_ended():
    with CpuMeter(period_s=0.02) as meter:
        time.sleep(0.05)
        t0 = time.time()
        subprocess.run([sys.executable, "-c", "import time\nend = time.time() + 0.5\nwhile time.time() < end: pass"],
                       check=True)
        t1 = time.time()
        use = meter.use(t0, t1)
    assert use is not None
    assert use.ours > 0.05 and use.machine >= use.ours - 0.05


def test_a_meter_started_after_the_window_measures_nothing():
    with CpuMeter() as meter:
        assert meter.use(time.time() - 10, time.time()) is None


def test_a_saturated_burst_means_the_conditions_do_not_hold():
    cpu = {"cores": 2, "machine_busy": 0.5, "ours": 0.4, "others": 0.1, "saturated": False}
    bursts = {"pfs": {"cpu": cpu}, "ours": {"cpu": {**cpu, "machine_busy": 0.97, "saturated": True}}}
    conditions = _conditions(bursts)
    assert conditions["hold"] is False and "'ours'" in conditions["why"] and "97%" in conditions["why"]
    assert _conditions({"pfs": {"cpu": cpu}})["hold"] is True
