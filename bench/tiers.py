"""``kvbench tiers``: put/get bandwidth of each tier against the machine's limits, in one run.

For chunks shaped like a real model's (default SmolLM2-135M: 30 layers, 3 KV heads,
head_dim 64, 256 tokens, fp16):

- host: put = blob into the page pool; get = blob out of the pool into a caller-provided,
  reused destination buffer (header buffer + tensor bytes). Limit: the best memcpy of the same
  pool pages into the same destination, and of the same payload into the same pages for the
  put (bench/limits.py: one thread, threads over slices, torch's copy).
- disk: put = write every chunk file, then sync the file system (so the figure is the
  disk's, not the page cache's); get = cold reads (each file's cached pages dropped with
  fdatasync + POSIX_FADV_DONTNEED first) into caller buffers with the tier's parallel reader.
  Limit: the best cold read of the same files, buffered or O_DIRECT, 1 to 8 in flight,
  measured in turns with the tier's reads (the disk's speed drifts over minutes).
- store: the Store facade end to end, with write-behind's defaults (a put returns once the
  chunk is in host RAM, its disk copy written behind; verify header, checksum where
  configured, decode): the puts are one burst into host RAM sized for it, timed one by one
  (median and P99 beside the throughput: a burst that fits never waits for the disk), then
  a host hit and a cold disk hit, against the same limits (the cold get also against raw
  reads of its own files, in turns with it), to show what the layers above the
  tiers cost; and the cost
  of durability: a durable put returns once its disk copy is written and fsync'ed (file and
  directory), against a put that returns once the chunk is in host RAM.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack

import numpy as np

from bench.cli import UsageError
from bench.limits import Limit, best_over, disk_read_limit, drop_cache, memcpy_limit, over_limit
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys
from tiers.disk import HASH_SLICE_BYTES, DiskTier
from tiers.files import TMP_SUFFIX
from tiers.host import HostTier
from tiers.read_probe import read_form

# torch, the blob header, the codecs and the Store are imported where they run: `kvbench --help`
# and a mistyped argument (here or in `kvbench peers`, which takes READ_FORMS) go without their
# seconds of start-up.
READ_FORMS = {"buffered": False, "direct": True, "auto": "auto"}  # --read-form -> disk.o_direct

GB = 1e9


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tiers", help="put/get GB/s per tier vs memcpy and raw disk reads")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--chunks", type=int, default=48, help="chunks per measurement")
    p.add_argument("--repeat", type=int, default=3, help="measurements per figure; the best is kept")
    p.add_argument("--read-threads", type=int, default=4)
    p.add_argument("--read-form", default="buffered", choices=list(READ_FORMS),
                   help="how the disk tier reads: through the page cache, with O_DIRECT, or auto (disk.o_direct)")
    p.add_argument("--dir", default=None, help="directory for the disk tier (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def _prefaulted(nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


def _best(fn, repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` runs of ``fn`` (which may prepare and return its own time)."""
    return min(fn() for _ in range(repeat))


def run(args) -> int:
    if args.chunks <= 0 or args.repeat <= 0:
        raise UsageError("--chunks and --repeat must be positive")
    import torch

    from kvstore.blob import encode_header
    from kvstore.codecs.raw import tensor_bytes

    ns = Namespace("kvbench", args.layers, args.kv_heads, args.head_dim, args.dtype, args.tokens)
    dtype = getattr(torch, args.dtype)
    keys = chunk_keys(list(range(args.chunks * args.tokens)), ns)
    chunk = torch.randn(ns.chunk_shape).to(dtype)
    payload = tensor_bytes(chunk)
    payload_bytes = len(payload)
    headers = [encode_header(k, 0, dtype, chunk.shape, payload) for k in keys]
    total = args.chunks * payload_bytes
    owned_dir = args.dir is None
    root = args.dir or tempfile.mkdtemp(prefix="kvbench-tiers-")
    results: dict[str, dict] = {}
    try:
        disk = _disk_tier(keys, payload, args, os.path.join(root, "disk"))  # an unusable --dir fails now
        results["host"] = _bench_host(keys, headers, payload, args)
        results["disk"] = _bench_disk(disk, keys, headers, payload, args)
        store = _bench_store(ns, keys, chunk, args, os.path.join(root, "store"))
    finally:
        if owned_dir:
            shutil.rmtree(root, ignore_errors=True)
    for r in results.values():
        r["get_vs_limit"] = r["get_gbps"] / r["limit_gbps"]
    host, disk = results["host"], results["disk"]
    host["put_vs_limit"] = host["put_gbps"] / host["put_limit"]["gbps"]
    store["put_vs_memcpy"] = store["put_gbps"] / host["put_limit"]["gbps"]
    store["host_get_vs_memcpy"] = store["host_get_gbps"] / host["limit_gbps"]
    cold_limit = best_over([_limit(disk["get_limit"]), _limit(store["cold_get_limit"])])
    store["cold_get_limit"] = cold_limit.as_dict()
    store["cold_disk_get_vs_raw_read"] = store["cold_disk_get_gbps"] / cold_limit.gbps
    warnings = (over_limit({"host get": host["get_gbps"], "store get from host": store["host_get_gbps"]}, _limit(host["get_limit"]))
                + over_limit({"host put": host["put_gbps"], "store put": store["put_gbps"]}, _limit(host["put_limit"]))
                + over_limit({"disk get": disk["get_gbps"]}, _limit(disk["get_limit"]))
                + over_limit({"store cold get": store["cold_disk_get_gbps"]}, cold_limit))
    report = {
        "chunk_bytes": payload_bytes,
        "chunks": args.chunks,
        "bytes_per_measurement": total,
        "tiers": results,
        "store": store,
        "over_limit": warnings,
    }
    _print_table(report)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _limit(d: dict) -> Limit:
    return Limit(d["gbps"], d["config"], d["tried"])


def _limit_fields(limit: Limit, name: str) -> dict:
    return {"limit_gbps": limit.gbps, "limit": name, "limit_config": limit.config, "get_limit": limit.as_dict()}


def _bench_host(keys, headers, payload, args) -> dict:
    from kvstore.blob import HEADER_BYTES

    payload_bytes = len(payload)
    tier = HostTier(len(keys) * (payload_bytes + HEADER_BYTES) + (64 << 20))
    dst = _prefaulted(payload_bytes)
    hdr = bytearray(HEADER_BYTES)
    total = len(keys) * payload_bytes

    def put() -> float:
        t = time.perf_counter()
        for k, h in zip(keys, headers):
            tier.write(k.id, [h, payload])
        return time.perf_counter() - t

    def get() -> float:
        t = time.perf_counter()
        for k in keys:
            tier.read_into(k.id, [hdr, dst])
        return time.perf_counter() - t

    put_s = _best(put, args.repeat)
    get_s = _best(get, args.repeat)
    assert bytes(dst[:64]) == bytes(payload[:64])
    src = np.frombuffer(payload, dtype=np.uint8)
    with ExitStack() as pins:  # the limits copy the very pool pages the gets read and the puts wrote
        pages = [_payload_pages(pins.enter_context(tier.pinned(k.id))) for k in keys]
        get_limit = memcpy_limit([pair for p in pages for pair in _pairs(dst, p)], args.repeat)
        put_limit = memcpy_limit([pair for p in pages for pair in _pairs(src, p, reverse=True)], args.repeat)
    tier.close()
    return {"put_gbps": total / put_s / GB, "get_gbps": total / get_s / GB, **_limit_fields(get_limit, "memcpy"),
            "put_limit": put_limit.as_dict()}


def _payload_pages(views) -> list[np.ndarray]:
    """A pinned blob's pool views as byte arrays, without its header."""
    from kvstore.blob import HEADER_BYTES

    arrays = [np.frombuffer(v, dtype=np.uint8) for v in views]
    skip, out = HEADER_BYTES, []
    for a in arrays:
        out.append(a[min(skip, a.size):])
        skip = max(0, skip - a.size)
    return [a for a in out if a.size]


def _pairs(flat: np.ndarray, pages: list[np.ndarray], reverse: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """(dst, src) pairs between ``flat`` and the pages, in order: out of the pages into ``flat``
    (a get), or out of ``flat`` into the pages (``reverse``: a put)."""
    pairs, off = [], 0
    for page in pages:
        piece = flat[off : off + page.size]
        pairs.append((page, piece) if reverse else (piece, page))
        off += page.size
    return pairs


def _disk_tier(keys, payload, args, path) -> DiskTier:
    """The disk tier to measure, opened before the host's seconds of measuring."""
    return DiskTier(path, 2 * len(keys) * (len(payload) + 8192), read_threads=args.read_threads)


def _bench_disk(tier: DiskTier, keys, headers, payload, args) -> dict:
    from kvstore.blob import HEADER_BYTES

    payload_bytes = len(payload)
    if args.read_form != "buffered":  # auto: as a Store decides, with the probe's figures for this device
        tier.o_direct = args.read_form == "direct" or read_form(str(tier.root), None, TMP_SUFFIX, HASH_SLICE_BYTES)[0]
    files = [str(tier.path_of(k.id)) for k in keys]
    total = len(keys) * payload_bytes
    ring = [(bytearray(HEADER_BYTES), _prefaulted(payload_bytes)) for _ in range(2 * args.read_threads)]
    outs = [[memoryview(h), memoryview(p)] for h, p in (ring[i % len(ring)] for i in range(len(keys)))]

    def put() -> float:
        for k in keys:
            tier.delete(k.id)
        os.sync()
        t = time.perf_counter()
        for k, h in zip(keys, headers):
            tier.write(k.id, [h, payload])
        os.sync()
        return time.perf_counter() - t

    def get() -> float:
        drop_cache(files)
        t = time.perf_counter()
        sizes = tier.read_many_into([k.id for k in keys], outs)
        elapsed = time.perf_counter() - t
        if sizes != [payload_bytes + HEADER_BYTES] * len(keys):
            raise RuntimeError("disk tier read back the wrong sizes")
        return elapsed

    put_s = _best(put, args.repeat)
    get_s, limit = _interleaved(get, lambda: disk_read_limit(files), args.repeat)
    tier.close()
    return {
        "put_gbps": total / put_s / GB,
        "get_gbps": total / get_s / GB,
        **_limit_fields(limit, "raw_read"),
        "read_form": args.read_form,
        "read_threads": args.read_threads,
    }


def _interleaved(ours, limit, repeat: int) -> tuple[float, Limit]:
    """The fastest of ``repeat`` runs of ``ours`` (seconds) and the best over ``repeat``
    measurements of its ``limit``, taken in turns (which goes first alternates): this disk's
    speed drifts by 2-4x over minutes, and a limit measured only after ours once came out
    below ours."""
    seconds, limits = [], []
    for r in range(repeat):
        if r % 2:
            limits.append(limit())
        seconds.append(ours())
        if not r % 2:
            limits.append(limit())
    return min(seconds), best_over(limits)


def _bench_store(ns, keys, chunk, args, path) -> dict:
    """Host RAM holds every chunk (the put burst fits in it); the last quarter are read from
    it, the rest cold from disk (dropped from host RAM before each cold read)."""
    import torch

    from kvstore.blob import HEADER_BYTES
    from kvstore.store import Store

    blob = chunk.numel() * chunk.element_size() + HEADER_BYTES
    resident = max(2, len(keys) // 4)
    cfg = StoreConfig(
        host=HostTierConfig(capacity_bytes=len(keys) * (blob + (256 << 10))),
        disk=DiskTierConfig(path=path, capacity_bytes=2 * len(keys) * (blob + 8192),
                            o_direct=READ_FORMS[args.read_form], read_threads=args.read_threads),
    )
    payload_bytes = chunk.numel() * chunk.element_size()
    out = torch.empty_like(chunk)
    out.zero_()
    with Store(cfg) as store:
        put_ms = []
        t = time.perf_counter()
        for k in keys:  # each put returns once its chunk is in host RAM
            started = time.perf_counter()
            store.put(k, chunk)
            put_ms.append((time.perf_counter() - started) * 1e3)
        put_s = time.perf_counter() - t
        store.flush()
        flushed_s = time.perf_counter() - t
        in_host, cold = keys[-resident:], keys[:-resident]

        def host_get() -> float:
            t = time.perf_counter()
            for k in in_host:
                store.get_into(k, out)
            return time.perf_counter() - t

        host_s = _best(host_get, args.repeat)
        cold_files = [str(store.tier("disk").path_of(k.id)) for k in cold]
        outs = [torch.zeros_like(chunk) for _ in cold]  # reused staging buffers, as a connector has

        def cold_get() -> float:
            store.drop(cold, "host")  # a cold get promotes what it read
            drop_cache(cold_files)
            t = time.perf_counter()
            got = list(store.stream(cold, outs=outs))
            elapsed = time.perf_counter() - t
            if len(got) != len(cold):
                raise RuntimeError("store lost chunks during the benchmark")
            return elapsed

        disk_s, cold_limit = _interleaved(cold_get, lambda: disk_read_limit(cold_files), args.repeat)
        direct = getattr(store.tier("disk"), "o_direct", False)
        form = f"{'O_DIRECT' if direct else 'buffered'}, {store.fetch_workers['disk']} in flight"
        durable = keys[: max(1, len(keys) // 4)]
        store.delete(durable)
        t = time.perf_counter()
        for k in durable:
            store.put(k, chunk, durable=True)
        durable_s = time.perf_counter() - t
    return {
        "put_gbps": len(keys) * payload_bytes / put_s / GB,
        "put_p50_ms": float(np.percentile(put_ms, 50)),
        "put_p99_ms": float(np.percentile(put_ms, 99)),
        "put_ms": put_ms,
        "put_and_flush_gbps": len(keys) * payload_bytes / flushed_s / GB,
        "host_get_gbps": len(in_host) * payload_bytes / host_s / GB,
        "cold_disk_get_gbps": len(cold) * payload_bytes / disk_s / GB,
        "durable_put_gbps": len(durable) * payload_bytes / durable_s / GB,
        "durable_put_ms": durable_s / len(durable) * 1e3,
        "cold_get_limit": cold_limit.as_dict(),
        "cold_get_form": form,
    }


def _print_table(report: dict) -> None:
    mb = report["chunk_bytes"] / 2**20
    print(f"chunk {mb:.2f} MiB x {report['chunks']} chunks")
    print(f"{'tier':<6} {'put GB/s':>9} {'get GB/s':>9} {'limit GB/s':>11} {'limit':>9} {'get/limit':>10}  limit's configuration")
    for name, r in report["tiers"].items():
        print(f"{name:<6} {r['put_gbps']:9.2f} {r['get_gbps']:9.2f} {r['limit_gbps']:11.2f} {r['limit']:>9} "
              f"{r['get_vs_limit']:10.2f}  {r['limit_config']}")
    put_limit = report["tiers"]["host"]["put_limit"]
    print(f"host put limit: memcpy into the pool {put_limit['gbps']:.2f} GB/s ({put_limit['config']}); "
          f"put/limit {report['tiers']['host']['put_vs_limit']:.2f}")
    s = report["store"]
    print(f"store  put {s['put_gbps']:.2f} GB/s ({s['put_vs_memcpy']:.2f}x memcpy; P50 {s['put_p50_ms']:.1f} ms, "
          f"P99 {s['put_p99_ms']:.1f} ms a put; into host RAM, while the disk copies are written behind; "
          f"{s['put_and_flush_gbps']:.2f} GB/s until they are all written), "
          f"get from host {s['host_get_gbps']:.2f} GB/s ({s['host_get_vs_memcpy']:.2f}x), cold get from disk "
          f"{s['cold_disk_get_gbps']:.2f} GB/s ({s['cold_get_form']}; {s['cold_disk_get_vs_raw_read']:.2f}x raw read "
          f"{s['cold_get_limit']['gbps']:.2f} GB/s, {s['cold_get_limit']['config']})")
    print(f"store  durable put {s['durable_put_gbps']:.2f} GB/s ({s['durable_put_ms']:.1f} ms a chunk: "
          f"written and fsync'ed on disk before it returns)")
