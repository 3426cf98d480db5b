"""Token dropping's probe on the real SmolLM2 weights (short prefix and continuation)."""

import json

import torch

from bench.cli import main
from bench.probe_drop import keep_set


def test_a_keep_set_holds_the_sinks_the_window_and_the_best_of_the_rest():
    scores = torch.tensor([0.0, 0, 0, 0, 5, 1, 9, 2, 0, 0])
    keep = keep_set(scores, keep=8, window=2)
    assert keep.tolist() == [True] * 4 + [True, False, True, False, True, True]


def test_dropping_nothing_changes_nothing_and_dropping_half_costs_quality(tmp_path):
    out = tmp_path / "drop.json"
    assert main(["probe-drop", "--tokens", "96", "--continuation", "48", "--keep", "1.0,0.5", "--window", "16",
                 "--json", str(out)]) == 0
    whole, half = json.loads(out.read_text())["rows"]
    assert abs(whole["attention"]) < 1e-6 and abs(whole["recent"]) < 1e-6
    assert half["keep_fraction"] == 0.5 and half["recent"] > 0 and half["codec"]["name"]
