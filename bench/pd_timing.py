"""``kvbench pd``'s timing, with real processes: a prefill node and a decode node (two daemons
whose PFS tier, one shared directory capped at ``--link-gbps``, is the link between them),
colocated and disaggregated engines per configuration, each request run through every
configuration back to back; TTFT, time per output token and the bytes over the link."""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path

from bench.progress import Progress, say

GB = 1e9


def daemon_toml(root: Path, name: str, pfs: Path, link_bytes_per_s: int) -> Path:
    path = root / f"{name}.toml"
    path.write_text(f"""listen = "127.0.0.1:0"
[shm]
slots = 8
slot_bytes = "16MiB"
[store.host]
capacity_bytes = "512MiB"
[store.disk]
enabled = false
[store.pfs]
enabled = true
path = "{pfs}"
capacity_bytes = "8GiB"
read_bytes_per_s = {link_bytes_per_s}
""")
    return path


def timing(model: str, args, root: Path, requests) -> dict:
    from connector import ConnectorConfig, DaemonBackendConfig
    from connector.config import TransferConfig
    from engine.config import EngineConfig
    from engine.pd import EngineSpec
    from engine.router import EngineProcess, Router
    from kvstore.client import Client
    from kvstore.daemon.spawn import DaemonProcess

    pfs = root / "pfs"
    pfs.mkdir()
    link = int(args.link_gbps * GB)
    # Every process spends seconds importing before it serves: start (and stop) them side by side.
    pool = ThreadPoolExecutor(8)
    daemons = {n: pool.submit(DaemonProcess, ["--config", str(daemon_toml(root, n, pfs, link)),
                                              "--data-dir", str(root / n)])
               for n in ("prefill-node", "decode-node")}
    daemons = {n: f.result() for n, f in daemons.items()}
    longest = max(len(r.prompt) + r.params.max_tokens for r in requests)
    blocks = -(-longest // 16) * 2 + 16
    names = ["colocated", "raw"] + args.codecs

    def engine(name, role, node):
        conn = None
        if role != "colocated":
            d = daemons[node]
            conn = ConnectorConfig(
                backend="daemon", daemon=DaemonBackendConfig(addr=d.addr, timeout_s=30.0),
                chunk_tokens=args.chunk_tokens, role={"prefill": "producer", "decode": "consumer"}[role],
                tenant=f"pd-{name}", max_pending_saves=64,
                transfer=TransferConfig(codec=name, importance=args.importance,
                                        wait_s=30.0))
        cfg = EngineConfig(num_blocks=blocks, block_size=16, max_num_batched_tokens=512, dtype="float32",
                           connector=conn)
        return EngineProcess(EngineSpec(model, cfg, role, args.threads))

    engines: dict[str, list] = {}
    try:
        say("pd", f"starting engines: {', '.join(names)}")
        starting = {name: [pool.submit(engine, name, "colocated", None)] if name == "colocated" else
                    [pool.submit(engine, name, "prefill", "prefill-node"),
                     pool.submit(engine, name, "decode", "decode-node")] for name in names}
        # each engine process loads the model on two shared cores: a minute or more for all of them
        every = [f for futures in starting.values() for f in futures]
        started = Progress(len(every), "engines started", every_s=10.0)
        for _ in as_completed(every):
            started.step()
        for name, futures in starting.items():
            engines[name] = [f.result() for f in futures if f.exception() is None]  # closed below if others failed
        for futures in starting.values():
            for f in futures:
                f.result()
        routers = {n: Router(e[0]) if n == "colocated" else Router(e[1], e[0]) for n, e in engines.items()}
        warm = requests[0]
        for router in routers.values():
            # reversed: no prefix in common with a timed request (it would hit the local prefix cache)
            router.run([replace(warm, request_id="warm", prompt=warm.prompt[::-1][: args.chunk_tokens + 8])])
        served = {n: [] for n in names}
        links = {n: [] for n in names}
        for i, r in enumerate(requests):
            # each request in every configuration back to back (they see the same machine), in an
            # order rotated per request (so no configuration always runs first)
            for name in names[i % len(names):] + names[:i % len(names)]:
                before = {n: _pfs(Client, d) for n, d in daemons.items()}
                served[name] += routers[name].run([r])
                links[name].append((before, {n: _pfs(Client, d) for n, d in daemons.items()}))
                say("pd", f"{name}: {r.request_id} ({len(r.prompt)} prompt tokens) ttft {served[name][-1].ttft_s:.3f}s")
        return {n: summarize(served[n], links[n], [e.ask("stats")["stats"] for e in engines[n]], n) for n in names}
    finally:
        list(pool.map(lambda e: e.close(), [e for es in engines.values() for e in es]))
        list(pool.map(lambda d: d.stop(), daemons.values()))
        pool.shutdown()


def _pfs(client_cls, daemon) -> dict:
    with client_cls(daemon.addr) as c:
        t = c.stats().tiers["pfs"]
        return {"written": t.bytes_written, "read": t.bytes_read}


def summarize(served, links, stats, name) -> dict:
    n = len(served)

    def link(node, field):
        return sum(after[node][field] - before[node][field] for before, after in links) // n

    out = {
        "ttft_mean_s": statistics.fmean(s.ttft_s for s in served),
        "ttft_s": [s.ttft_s for s in served],
        "tpot_mean_s": statistics.fmean(s.tpot_s for s in served),
        "second_token_mean_s": statistics.fmean(s.token_times[1] - s.token_times[0] for s in served),
        # steady decoding: from the second token on (the second includes a decode's load)
        "tpot_decode_mean_s": statistics.fmean((s.token_times[-1] - s.token_times[1]) / (len(s.token_times) - 2)
                                               for s in served if len(s.token_times) > 2),
        "transfer_bytes": 0, "link_read_bytes": 0, "put_s": 0.0, "load_s": 0.0, "transfer_s": 0.0,
        "loaded_tokens": 0, "wait_timeouts": 0, "rerouted": 0,
        "outputs": [s.token_ids for s in served],
    }
    if name != "colocated":
        producer = stats[0].connector
        out.update(
            transfer_bytes=link("prefill-node", "written"), link_read_bytes=link("decode-node", "read"),
            put_s=producer.put_s / n, load_s=statistics.fmean(s.decode.kv_load_s for s in served),
            loaded_tokens=sum(s.decode.loaded_tokens for s in served) // n,
            wait_timeouts=sum(s.decode.wait_timed_out for s in served), rerouted=sum(s.rerouted for s in served))
        out["transfer_s"] = out["put_s"] + out["load_s"]
        out["promised_tokens"] = sum(s.prefill.transfer.num_tokens for s in served) // n
    return out
