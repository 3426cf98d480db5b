"""``kvbench connector``'s real-text TTFT: prompts a user would send, not token ranges.

A real prompt's length is no multiple of the chunk size, and chat prompts carry the model's
template. Six prompts of about ``--text-tokens`` tokens each are built from text this
checkout ships (prose, documentation, Python source, a chat and a multi-turn chat in the
model's chat template), cut at a paragraph or line boundary, so their lengths fall where
they fall. For each prompt: the greedy output with the store equals the cold one (a
mismatch is an error, never a figure), then ``--repeats`` interleaved rounds of a cold
prefill, a hit from host RAM (in-process Store) and a hit through the daemon over shared
memory, in an order that rotates each round so all three see the same machine. Each hit
ratio is the median of the per-round ratios hit/cold; the summary is the median over the
prompts, with the smallest and largest.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HITS = ("host", "shm")
OUTPUT_TOKENS = 8  # greedy tokens compared between the cold run and each hit


def progress(message: str) -> None:
    print(f"kvbench connector: {message}", file=sys.stderr, flush=True)


def _paragraphs(*names: str) -> list[str]:
    return [p for name in names for p in (ROOT / name).read_text().split("\n\n") if p.strip()]


def _lines(*names: str) -> list[str]:
    return [line for name in names for line in (ROOT / name).read_text().splitlines(keepends=True)]


def _fill(pieces: list[str], fits) -> list[str]:
    """The leading ``pieces`` up to the first whose addition reaches the target (it is kept)."""
    taken = []
    for piece in pieces:
        taken.append(piece)
        if fits(taken):
            break
    return taken


def text_prompts(tokenizer, target: int, limit: int) -> dict[str, list[int]]:
    """Name -> token ids of about ``target`` tokens (at least, unless the source runs out), cut to
    ``limit`` (the model's context less the tokens generated) where a piece overshoots it."""
    def enough(text: str) -> bool:
        return len(tokenizer.encode(text)) >= target

    def chat(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages)

    prose = "\n\n".join(_fill(_paragraphs("bench/data/probe_prose.txt", "docs/store.md"),
                              lambda t: enough("\n\n".join(t))))
    docs = "\n\n".join(_fill(_paragraphs("docs/configuration.md"), lambda t: enough("\n\n".join(t))))
    code = "".join(_fill(_lines("kvstore/store/facade.py"), lambda t: enough("".join(t))))
    engine_code = "".join(_fill(_lines("engine/llm.py", "engine/scheduler.py"), lambda t: enough("".join(t))))
    question = "Summarise what this document promises, in three sentences."

    def chat_prompt(t: list[str]) -> str:
        return chat([{"role": "system", "content": "You are a careful technical reviewer."},
                     {"role": "user", "content": "\n\n".join(t) + "\n\n" + question}])

    turns = _paragraphs("docs/connector.md")

    def multi_turn(t: list[str]) -> str:
        messages = [{"role": "system", "content": "You answer questions about a KV-cache store."}]
        for i, paragraph in enumerate(t):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": paragraph})
        if messages[-1]["role"] == "user":
            messages.append({"role": "assistant", "content": "Noted."})
        messages.append({"role": "user", "content": "What did we settle on, and what is still open?"})
        return chat(messages)

    chats = {
        "chat": chat_prompt(_fill(_paragraphs("docs/daemon.md"), lambda t: enough(chat_prompt(t)))),
        "multi-turn chat": multi_turn(_fill(turns, lambda t: enough(multi_turn(t)))),
    }
    texts = {"prose": prose, "docs (tables)": docs, "python": code, "python (engine)": engine_code, **chats}
    return {name: tokenizer.encode(text)[:limit] for name, text in texts.items()}


def _ttft(llm, prompt: list[int]) -> dict:
    from engine import SamplingParams

    llm.reset_prefix_cache()
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    m = out.metrics
    return {"ttft_s": m.ttft, "loaded_tokens": m.num_loaded_tokens, "computed_tokens": m.num_prefilled_tokens}


def _greedy(llm, prompt: list[int]) -> list[int]:
    from engine import SamplingParams

    llm.reset_prefix_cache()
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True))
    return out.output_token_ids


def measure(base, setup, target: int) -> dict:
    """Every prompt through a store-less engine, one on an in-process Store (host RAM) and one on
    a daemon over shared memory; see the module's docstring."""
    from connector import DaemonBackendConfig
    from kvstore.daemon.spawn import DaemonProcess
    from kvstore.store import Store

    from bench.connector import kv_bytes_per_token

    prompts = text_prompts(base.tokenizer, target, base.max_model_len - OUTPUT_TOKENS - 1)
    longest = max(len(p) for p in prompts.values())
    engine = dict(num_blocks=longest // setup.block_size + 16, max_num_batched_tokens=longest + setup.block_size)
    per_token = kv_bytes_per_token(base)
    host_bytes = 2 * sum(len(p) for p in prompts.values()) * per_token + (256 << 20)
    config = setup.root / "text-daemon.toml"  # the daemon's own shared-memory slots, as users run it
    config.write_text(f'[store.host]\ncapacity_bytes = {host_bytes}\npage_bytes = {1 << 20}\n'
                      f'[store.disk]\nenabled = false\n')
    results = {}
    with Store(setup.store_config(host_bytes, setup.root / "text-disk")) as store, \
            DaemonProcess(["--config", str(config), "--listen", "127.0.0.1:0"]) as daemon, \
            base.with_config(**engine) as plain, \
            base.with_config(kv_store=store, connector=setup.connector_config(), **engine) as host, \
            base.with_config(connector=setup.connector_config(
                backend="daemon", daemon=DaemonBackendConfig(addr=daemon.addr, transport="shm")), **engine) as shm:
        engines = {"cold": plain, "host": host, "shm": shm}
        for name, prompt in prompts.items():
            progress(f"real text '{name}' ({len(prompt)} tokens): saving, checking outputs, then "
                     f"{setup.repeats} rounds of cold / host / shm")
            want = _greedy(plain, prompt)
            for source in HITS:
                _greedy(engines[source], prompt)  # saves the prompt's chunks and tail
                engines[source].flush_saves()
                got = _greedy(engines[source], prompt)
                if got != want:
                    raise RuntimeError(f"'{name}': the output with a {source} hit differs from the cold one: "
                                       f"{got} != {want}")
            rounds = []
            order = ["cold", *HITS]
            for r in range(setup.repeats):
                runs = {}
                for source in order[r % 3:] + order[:r % 3]:
                    runs[source] = _ttft(engines[source], prompt)
                rounds.append(runs)
            results[name] = _prompt_summary(prompt, rounds)
            hit = results[name]
            progress(f"  cold {hit['cold_s']:.3f} s; " + "; ".join(
                f"{s} {hit['hit_s'][s]:.3f} s ({hit['hit_vs_cold'][s]:.3f}x)" for s in HITS))
    return {"target_tokens": target, "output_tokens_compared": OUTPUT_TOKENS, "prompts": results,
            "summary": _summary(results)}


def _prompt_summary(prompt: list[int], rounds: list[dict]) -> dict:
    hits = {s: [r[s] for r in rounds] for s in HITS}
    return {
        "tokens": len(prompt),
        "loaded_tokens": {s: hits[s][0]["loaded_tokens"] for s in HITS},
        "computed_tokens": {s: hits[s][0]["computed_tokens"] for s in HITS},
        "cold_s": statistics.median(r["cold"]["ttft_s"] for r in rounds),
        "hit_s": {s: statistics.median(run["ttft_s"] for run in hits[s]) for s in HITS},
        "hit_vs_cold": {s: statistics.median(r[s]["ttft_s"] / r["cold"]["ttft_s"] for r in rounds) for s in HITS},
        "rounds": rounds,
    }


def _summary(results: dict) -> dict:
    out = {}
    for s in HITS:
        ratios = [r["hit_vs_cold"][s] for r in results.values()]
        out[s] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def format_table(r: dict) -> list[str]:
    lines = [f"real text (~{r['target_tokens']} tokens; outputs equal cold for {r['output_tokens_compared']} greedy "
             f"tokens): TTFT (s), medians of interleaved rounds; hit/cold is the median of per-round ratios",
             f"{'prompt':18} {'tokens':>6} {'loaded':>6} {'cold':>7} {'host':>7} {'shm':>7} {'host/cold':>9} "
             f"{'shm/cold':>8}"]
    for name, p in r["prompts"].items():
        lines.append(f"{name:18} {p['tokens']:6} {p['loaded_tokens']['host']:6} {p['cold_s']:7.3f} "
                     f"{p['hit_s']['host']:7.3f} {p['hit_s']['shm']:7.3f} {p['hit_vs_cold']['host']:9.3f} "
                     f"{p['hit_vs_cold']['shm']:8.3f}")
    lines.append("hit/cold over the prompts, median (min-max): " + "; ".join(
        f"{s} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for s, v in r["summary"].items()))
    return lines
