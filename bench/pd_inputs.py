"""``kvbench pd``'s inputs: request lengths from the Mooncake trace, prompts from the
repository's prose, and the needle-in-a-haystack prompts with their question and answer."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

_FULL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl.gz"
DEFAULT_TRACE = _FULL_TRACE if _FULL_TRACE.exists() else Path(__file__).parent / "data" / "mooncake_conversation_head2000.jsonl.gz"
PROBE_TEXT = Path(__file__).parent / "data" / "probe_prose.txt"
DOCS = Path(__file__).resolve().parents[1] / "docs"
NEEDLE = "The special magic number is 73914. "
NEEDLE_ANSWER = "73914"
QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"


def trace_lengths(path: str, n: int, prompt_scale: float, output_scale: float, max_prompt: int,
                  max_output: int, min_prompt: int) -> list[tuple[int, int]]:
    """The first ``n`` requests' (prompt, output) lengths of a Mooncake trace, scaled down."""
    out = []
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for line in f:
            if len(out) == n:
                break
            r = json.loads(line)
            out.append((min(max_prompt, max(min_prompt, int(r["input_length"] * prompt_scale))),
                        min(max_output, max(2, int(r["output_length"] * output_scale)))))
    if len(out) < n:
        raise ValueError(f"{path} has {len(out)} requests, {n} wanted")
    return out


def corpus_tokens(tokenizer) -> list[int]:
    """Tokens of the repository's prose (docs/*.md, then the probe text), for prompts."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))
    return tokenizer.encode(text + "\n\n" + PROBE_TEXT.read_text(encoding="utf-8"))


def needle_prompt(tokenizer, corpus: list[int], length: int) -> list[int]:
    """``length`` tokens of prose with the needle at half depth, then the question, as a chat turn."""
    text = tokenizer.decode(corpus[:length])
    cut = text.rfind(". ", 0, len(text) // 2) + 2
    doc = text[:cut] + NEEDLE + text[cut:]
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": doc + QUESTION}]))
