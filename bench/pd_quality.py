"""``kvbench pd``'s quality, in-process on one Store: each codec's perplexity change on the
probe text, greedy exact-match against raw on held prompts, and needle retrieval, through a
producer's encoding and a consumer's decode."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from bench.pd_inputs import NEEDLE_ANSWER, PROBE_TEXT, needle_prompt
from bench.progress import say


def quality(base, model_path, args, corpus: list[int]) -> dict:
    """Per codec: perplexity change on the probe text, greedy exact-match vs raw on held
    prompts, needle retrieval, through a producer's encoding and a consumer's decode."""
    from connector import ConnectorConfig
    from connector.config import TransferConfig
    from connector.roles import TransferCodecs
    from engine.sampling import SamplingParams
    from kvstore.keys import Namespace, chunk_keys
    from kvstore.store import Store

    store = Store(_store_config())
    step = args.held_tokens + 97
    held = [corpus[i * step:i * step + args.held_tokens] for i in range(args.held_prompts)]
    needles = {n: needle_prompt(base.tokenizer, corpus[len(corpus) // 3:], n) for n in args.needle_lengths}
    prompts = held + list(needles.values())
    greedy = SamplingParams(max_tokens=args.max_output, temperature=0, ignore_eos=True)
    answer = SamplingParams(max_tokens=24, temperature=0)
    mc = base.model_config

    def connector(role, tenant):
        return ConnectorConfig(chunk_tokens=args.chunk_tokens, role=role, tenant=tenant, max_pending_saves=64,
                               transfer=TransferConfig(importance=args.importance))

    say("pd", "quality: prefill of the held and needle prompts and the probe text (raw)")
    ppl = Perplexity(model_path, base, args.chunk_tokens)
    producer = base.with_config(kv_store=store, connector=connector("producer", ""))
    masses = {}  # with --importance attention: the prefill's observed attention, per prompt
    if args.importance == "attention":  # a raw producer does not observe by itself: ask its runner
        producer.runner.observe_window = TransferConfig().observe_tokens
    worker = producer.connector.worker
    keep = worker.set_attention_mass
    worker.set_attention_mass = lambda m: (masses.update(m), keep(m))
    for i, p in enumerate(prompts + [ppl.prefix.tolist()]):
        producer.add_request(p, SamplingParams(max_tokens=1, temperature=0), request_id=f"q{i}")
    while producer.has_unfinished():
        producer.step()
    producer.flush_saves()
    producer.close()
    ppl.attention = masses.get(f"q{len(prompts)}")
    raw_ns = Namespace(base.model_id, mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, args.chunk_tokens)

    def decode(tenant):
        consumer = base.with_config(kv_store=store, connector=connector("consumer", tenant))
        try:
            outs = consumer.generate(held, greedy) + consumer.generate(list(needles.values()), answer)
        finally:
            consumer.close()
        return outs

    results = {}
    reference = None
    for name in ["raw"] + args.codecs:
        say("pd", f"quality: {name}")
        tenant = "" if name == "raw" else f"q-{name}"
        if name != "raw":
            codecs = TransferCodecs(TransferConfig(codec=name, importance=args.importance))
            ns = replace(raw_ns, tenant=tenant)
            for j, p in enumerate(prompts):
                raw_keys, keys = chunk_keys(p, raw_ns), chunk_keys(p, ns)
                for i, (rk, k) in enumerate(zip(raw_keys, keys)):
                    chunk = store.get([rk])[0]
                    store.put(k, chunk, parent=keys[i - 1] if i else None,
                              codec=codecs.for_chunk(i == 0, _slice(masses.get(f"q{j}"), i, args.chunk_tokens)))
        outs = decode(tenant)
        texts = [o.text for o in outs[len(held):]]
        row = {
            "ppl_change_pct": ppl.change(name, args.importance),
            "held_outputs": [o.output_token_ids for o in outs[:len(held)]],
            "needle": {str(n): NEEDLE_ANSWER in t for n, t in zip(needles, texts)},
            "needle_text": texts,
            "loaded_tokens": sum(o.metrics.num_loaded_tokens for o in outs),
        }
        if reference is None:
            reference = row
        row["exact_match"] = sum(a == b for a, b in zip(row["held_outputs"], reference["held_outputs"])) / len(held)
        row["token_match"] = statistics.fmean(_common_prefix(a, b) / len(b) for a, b in
                                              zip(row["held_outputs"], reference["held_outputs"]))
        results[name] = row
    store.close()
    results["reference_ppl"] = ppl.reference
    return results


def _slice(mass, i: int, chunk_tokens: int):
    return None if mass is None else mass[:, i * chunk_tokens:(i + 1) * chunk_tokens]


def _store_config():
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig

    return StoreConfig(host=HostTierConfig(capacity_bytes=2 << 30), disk=DiskTierConfig(enabled=False))


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Perplexity:
    """The probe's measurement (bench/probe_model.py) on the engine's KV dtype: the KV of the
    probe text's first 512 tokens, its full chunks through a codec as a producer encodes them
    (the partial last one stays exact: the consumer computes it), 512 tokens scored after it."""

    def __init__(self, model_path, base, chunk_tokens: int, prefix: int = 512, continuation: int = 512) -> None:
        import torch

        from bench import probe_model
        from engine.testing import transformers_reference

        self.probe = probe_model
        self.loaded = probe_model.LoadedModel(base.model_id, transformers_reference(model_path), None)
        ids = torch.tensor(base.tokenizer.encode(PROBE_TEXT.read_text(encoding="utf-8")))
        need = prefix + continuation
        self.prefix, self.cont = ids[:prefix], ids[prefix:need]
        self.kv = probe_model.prefix_kv(self.loaded, self.prefix)
        self.chunk_tokens = chunk_tokens
        self.reference = self._ppl(self.kv)
        self.attention = None  # the engine's observed attention over the prefix (--importance attention)

    def _ppl(self, kv) -> float:
        import torch

        logits = self.probe.continuation_logits(self.loaded, kv, self.cont)
        return math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], self.cont[1:])))

    def change(self, name: str, importance: str) -> float:
        if name == "raw":
            return 0.0
        from connector.config import TransferConfig
        from connector.roles import TransferCodecs

        codecs = TransferCodecs(TransferConfig(codec=name, importance=importance))
        kv = self.kv.clone()
        c = self.chunk_tokens
        for i in range(kv.shape[2] // c):
            chunk = kv[:, :, i * c:(i + 1) * c].contiguous()
            codec = codecs.for_chunk(i == 0, _slice(self.attention, i, c))
            kv[:, :, i * c:(i + 1) * c] = codec.decode(codec.encode(chunk), tuple(chunk.shape), chunk.dtype)
        return (self._ppl(kv) / self.reference - 1.0) * 100.0
