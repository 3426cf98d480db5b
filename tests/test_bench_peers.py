"""``kvbench peers``: runs ours beside the limits without LMCache, and says how to install it."""

import json

from bench import peers
from bench.cli import main

def test_peers_without_a_peer_reports_ours_and_the_limits(tmp_path):
    out = tmp_path / "peers.json"
    rc = main(["peers", "--peer", "none", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--chunks", "4",
               "--rounds", "2", "--dir", str(tmp_path / "d"), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    (ours,) = report["rounds"].values()
    assert len(ours) == 2 and all(r[p] > 0 for r in ours for p in peers.PHASES)
    # every put timed: its median and P99 beside the throughput
    assert all(len(r["put_ms"]) == 4 and 0 < r["put_p50_ms"] <= r["put_p99_ms"] <= max(r["put_ms"]) for r in ours)
    for name in ("memcpy", "disk_read"):
        limit = report["limits"][name]
        assert limit["gbps"] == max(limit["tried"].values())
        assert limit["gbps"] == max(r[name]["gbps"] for r in ours)  # the best of every round's

def test_a_missing_lmcache_is_a_usage_error_that_says_how_to_install_it(monkeypatch, capsys):
    import builtins
    real = builtins.__import__

    def no_lmcache(name, *a, **k):
        if name == "lmcache":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_lmcache)
    assert main(["peers", "--chunks", "2"]) == 2
    assert "pip install lmcache==0.5.6" in capsys.readouterr().err
