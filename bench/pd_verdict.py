"""``kvbench pd``'s verdict: the issue's targets checked (raw TTFT against colocated, the best
codec within the perplexity bound whose every output equals raw's), and the table."""

from __future__ import annotations

import statistics

TARGETS = {"raw_ttft_vs_colocated": 1.3, "max_ppl_change_pct": 2.0, "min_bytes_cut": 2.0}


def outputs_equal_raw(run: dict) -> bool:
    """Every output of a run is raw's, token for token: the timed requests' streams, the held
    prompts' greedy continuations and the needle answers."""
    return (run["stream_exact_match_vs_raw"] == 1 and run.get("exact_match", 1.0) == 1
            and run.get("needle_text_equals_raw", True))


def checks(runs: dict) -> dict:
    """The issue's targets: raw TTFT vs colocated; the best codec (the largest cut in bytes over
    the link) within 2% perplexity of raw and its needle retrieval against raw's. A codec that
    changed any output is never the best, however small its perplexity change: perplexity
    is an average, and a user sees the changed text; such codecs are listed in
    ``changed_outputs`` instead."""
    raw = runs["raw"]
    out = {"raw_ttft_vs_colocated": raw["ttft_mean_s"] / runs["colocated"]["ttft_mean_s"],
           # per request (the same prompt back to back): steadier on a shared machine than the means
           "raw_ttft_vs_colocated_median": statistics.median(
               a / b for a, b in zip(raw["ttft_s"], runs["colocated"]["ttft_s"])),
           "targets": TARGETS}
    within = {name: r for name, r in runs.items() if name not in ("raw", "colocated") and r["transfer_bytes"]
              and abs(r["ppl_change_pct"]) <= TARGETS["max_ppl_change_pct"]}
    out["changed_outputs"] = [name for name, r in within.items() if not outputs_equal_raw(r)]
    ok = [(raw["transfer_bytes"] / r["transfer_bytes"], name) for name, r in within.items()
          if name not in out["changed_outputs"]]
    if ok:
        cut, best = max(ok)
        out.update(best_codec=best, best_bytes_cut=cut, best_ttft_vs_raw=runs[best]["ttft_mean_s"] / raw["ttft_mean_s"],
                   best_needle_equals_raw=runs[best]["needle"] == raw["needle"])
    return out


def format_table(r: dict) -> str:
    reqs = r["requests"]
    lines = [f"model {r['model']}  link {r['link_gbps']} GB/s  chunk {r['chunk_tokens']} tokens  "
             f"KV {r['kv_bytes_per_token']} B/token  {len(reqs)} requests one at a time, prompts "
             f"{[q['prompt_tokens'] for q in reqs]} tokens, outputs {[q['output_tokens'] for q in reqs]}",
             f"{'run':<10} {'TTFT s':>7} {'TPOT s':>7} {'2nd tok s':>9} {'TPOT 2+':>7} {'MB/req':>7} {'put s':>6} {'load s':>6} "
             f"{'ppl chg %':>9} {'exact':>5} {'tok match':>9} {'stream=raw':>10}  needle"]
    for name, x in r["runs"].items():
        needle = " ".join(f"{k}:{'y' if v else 'n'}" for k, v in x.get("needle", {}).items())
        lines.append(f"{name:<10} {x['ttft_mean_s']:7.3f} {x['tpot_mean_s']:7.3f} {x['second_token_mean_s']:9.3f} "
                     f"{x['tpot_decode_mean_s']:7.3f} "
                     f"{x['transfer_bytes'] / 1e6:7.1f} {x['put_s']:6.3f} {x['load_s']:6.3f} "
                     f"{x['ppl_change_pct']:+9.3f} {x.get('exact_match', 1.0):5.2f} {x.get('token_match', 1.0):9.2f} "
                     f"{x['stream_exact_match_vs_raw']:10.2f}  {needle}")
    c = r["checks"]
    lines.append(f"raw TTFT / colocated {c['raw_ttft_vs_colocated']:.3f} of the means, "
                 f"{c['raw_ttft_vs_colocated_median']:.3f} median per request (target <= {TARGETS['raw_ttft_vs_colocated']})")
    if "best_codec" in c:
        lines.append(f"best codec within {TARGETS['max_ppl_change_pct']}% perplexity, every output equal to raw: "
                     f"{c['best_codec']}, bytes cut {c['best_bytes_cut']:.2f}x (target >= {TARGETS['min_bytes_cut']}), "
                     f"TTFT vs raw {c['best_ttft_vs_raw']:.3f}, needle equal to raw: {c['best_needle_equals_raw']}")
    else:
        lines.append(f"no codec kept perplexity within {TARGETS['max_ppl_change_pct']}% of raw and every output "
                     "equal to raw's")
    if c["changed_outputs"]:
        lines.append(f"not a candidate, changed an output (exact, stream=raw or needle text): "
                     f"{', '.join(c['changed_outputs'])}")
    return "\n".join(lines)
