"""``kvbench tiers``: put/get bandwidth of each tier against the machine's limits, in one run.

For chunks shaped like a real model's (default SmolLM2-135M: 30 layers, 3 KV heads,
head_dim 64, 256 tokens, fp16):

- host: put = blob into the page pool; get = blob out of the pool into caller-provided,
  reused destination buffers (header buffer + tensor bytes), one per chunk, as a connector
  loads a prompt's chunks into blocks of its paged cache (one destination for every chunk
  stayed in the last-level cache: 46 GB/s for chunks of 5.6 MiB on a machine whose memory
  copies 12-26). Limit: the best memcpy of the same pool pages into the same destinations,
  and of the same payload into the same pages for the put (bench/limits.py: one thread,
  threads over slices, torch's copy).
- disk: put = write every chunk file, then sync the file system (so the figure is the
  disk's, not the page cache's); get = cold reads (each file's cached pages dropped with
  fdatasync + POSIX_FADV_DONTNEED first) into caller buffers with the tier's parallel reader.
  Limit: the best cold read of the same files, buffered or O_DIRECT, 1 to 8 in flight.
- store: the Store facade end to end, with write-behind's defaults (a put returns once the
  chunk is in host RAM, its disk copy written behind; verify header, checksum where
  configured, decode): the puts are one burst into host RAM sized for it, timed one by one
  (median and P99 beside the throughput: a burst that fits never waits for the disk), then
  a host hit and a cold disk hit, against the same limits (the cold get also against raw
  reads of its own files just before and just after it, the better kept), to show what the
  layers above the tiers cost; and the cost
  of durability: a durable put returns once its disk copy is written and fsync'ed (file and
  directory), against a put that returns once the chunk is in host RAM.

Every figure comes from ``--rounds`` rounds (bench/rounds.py): each round measures all three,
every figure of ours next to its limit, which goes first alternating from round to round;
printed as median (min-max), a ratio as the median of the per-round ratios. A measurement
that can be made again in its round (the host tier's put and get, the Store's get from host
RAM) is timed as often as each limit's configuration, the shortest kept (bench/limits.py
``best_time``); the Store's put burst and its cold get are timed once. The JSON keeps
every round, and flags any round where ours beat its limit by more than 5%.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import ExitStack

import numpy as np

from bench.cli import UsageError
from bench.limits import Limit, best_over, best_time, disk_read_limit, drop_cache, memcpy_limit
from bench.rounds import ROUNDS, Spread, in_turns, limit_summary, over_limit, over_limit_lines, ratio
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
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="interleaved rounds of ours and the limits; figures are their medians")
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


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(args) -> int:
    if args.chunks <= 0 or args.rounds <= 0:
        raise UsageError("--chunks and --rounds must be positive")
    import torch

    from kvstore.blob import encode_header
    from kvstore.codecs.raw import tensor_bytes

    ns = Namespace("kvbench", args.layers, args.kv_heads, args.head_dim, args.dtype, args.tokens)
    dtype = getattr(torch, args.dtype)
    keys = chunk_keys(list(range(args.chunks * args.tokens)), ns)
    chunk = torch.randn(ns.chunk_shape).to(dtype)
    payload = tensor_bytes(chunk)
    headers = [encode_header(k, 0, dtype, chunk.shape, payload) for k in keys]
    owned_dir = args.dir is None
    root = args.dir or tempfile.mkdtemp(prefix="kvbench-tiers-")
    try:
        with ExitStack() as benches:
            disk = benches.enter_context(DiskBench(keys, headers, payload, args, os.path.join(root, "disk")))
            host = benches.enter_context(HostBench(keys, headers, payload))  # an unusable --dir failed above
            store = benches.enter_context(StoreBench(ns, keys, chunk, args, os.path.join(root, "store")))
            rounds = []
            for r in range(args.rounds):
                h, d, s = in_turns(r, lambda: host.round(r), lambda: disk.round(r), lambda: store.round(r))
                rounds.append({"host": h, "disk": d, "store": s})
    finally:
        if owned_dir:
            shutil.rmtree(root, ignore_errors=True)
    report = _report(rounds, len(payload), args.chunks)
    _print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _report(rounds: list[dict], payload_bytes: int, chunks: int) -> dict:
    """Medians (the JSON keys a single run used to have), their spreads, the per-round ratios'
    medians, the over-limit flags, and every round (its limits as dicts)."""
    def of(section: str, key: str) -> list:
        return [r[section][key] for r in rounds]

    def gbps(limits: list[Limit]) -> list[float]:
        return [limit.gbps for limit in limits]

    get_limit, put_limit, disk_limit = of("host", "get_limit"), of("host", "put_limit"), of("disk", "get_limit")
    # the store's cold get against the best raw read of its round, of the disk tier's files or its own
    cold_limit = [best_over([d, s]) for d, s in zip(disk_limit, of("store", "cold_get_own_files_limit"))]
    measured = {"host": ("put_gbps", "get_gbps"), "disk": ("put_gbps", "get_gbps"),
                "store": ("put_gbps", "put_p50_ms", "put_p99_ms", "put_and_flush_gbps", "host_get_gbps",
                          "cold_disk_get_gbps", "durable_put_gbps", "durable_put_ms")}
    spreads = {section: {key: Spread.of(of(section, key)) for key in keys} for section, keys in measured.items()}
    spreads["host"]["limit_gbps"] = Spread.of(gbps(get_limit))
    spreads["host"]["get_vs_limit"] = ratio(of("host", "get_gbps"), gbps(get_limit))
    spreads["host"]["put_vs_limit"] = ratio(of("host", "put_gbps"), gbps(put_limit))
    spreads["disk"]["limit_gbps"] = Spread.of(gbps(disk_limit))
    spreads["disk"]["get_vs_limit"] = ratio(of("disk", "get_gbps"), gbps(disk_limit))
    s = spreads["store"]
    s["put_p99_vs_p50"] = ratio(of("store", "put_p99_ms"), of("store", "put_p50_ms"))
    s["put_vs_memcpy"] = ratio(of("store", "put_gbps"), gbps(put_limit))
    s["host_get_vs_memcpy"] = ratio(of("store", "host_get_gbps"), gbps(get_limit))
    s["cold_disk_get_vs_raw_read"] = ratio(of("store", "cold_disk_get_gbps"), gbps(cold_limit))
    flags = (over_limit("host get", of("host", "get_gbps"), get_limit)
             + over_limit("store get from host", of("store", "host_get_gbps"), get_limit)
             + over_limit("host put", of("host", "put_gbps"), put_limit)
             + over_limit("store put", of("store", "put_gbps"), put_limit)
             + over_limit("disk get", of("disk", "get_gbps"), disk_limit)
             + over_limit("store cold get", of("store", "cold_disk_get_gbps"), cold_limit))
    sections = {name: {key: spread.median for key, spread in figures.items()} | {"spread": {
        key: spread.as_dict() for key, spread in figures.items()}} for name, figures in spreads.items()}
    sections["host"].update(limit="memcpy", limit_config=limit_summary(get_limit)["config"],
                            get_limit=limit_summary(get_limit), put_limit=limit_summary(put_limit))
    sections["disk"].update(limit="raw_read", limit_config=limit_summary(disk_limit)["config"],
                            get_limit=limit_summary(disk_limit), read_form=rounds[0]["disk"]["read_form"],
                            read_threads=rounds[0]["disk"]["read_threads"])
    sections["store"].update(cold_get_limit=limit_summary(cold_limit), cold_get_form=rounds[0]["store"]["cold_get_form"])
    kept = []
    for r, limit in zip(rounds, cold_limit):
        kept.append({section: {k: v.as_dict() if isinstance(v, Limit) else v for k, v in figures.items()}
                     for section, figures in r.items()})
        kept[-1]["store"]["cold_get_limit"] = limit.as_dict()
    return {"chunk_bytes": payload_bytes, "chunks": chunks, "bytes_per_measurement": chunks * payload_bytes,
            "rounds": kept, "tiers": {"host": sections["host"], "disk": sections["disk"]},
            "store": sections["store"], "over_limit": flags}


class HostBench:
    """The host tier's put and get, and memcpy through the very pool pages they use."""

    def __init__(self, keys, headers, payload) -> None:
        from kvstore.blob import HEADER_BYTES

        self.keys, self.headers, self.payload = keys, headers, payload
        self.tier = HostTier(len(keys) * (len(payload) + HEADER_BYTES) + (64 << 20))
        self.dsts = [_prefaulted(len(payload)) for _ in keys]  # one a chunk: see the module's docstring
        self.hdr = bytearray(HEADER_BYTES)
        self.total = len(keys) * len(payload)

    def __enter__(self) -> "HostBench":
        return self

    def __exit__(self, *exc) -> None:
        self.tier.close()

    def _put(self) -> None:
        for k, h in zip(self.keys, self.headers):
            self.tier.write(k.id, [h, self.payload])

    def _get(self) -> None:
        for k, dst in zip(self.keys, self.dsts):
            self.tier.read_into(k.id, [self.hdr, dst])

    def _ours(self) -> tuple[float, float]:
        put_s, get_s = best_time(self._put), best_time(self._get)
        assert bytes(self.dsts[-1][:64]) == bytes(self.payload[:64])
        return self.total / put_s / GB, self.total / get_s / GB

    def _limits(self) -> tuple[Limit, Limit]:
        """The copies a get and a put make, through the pages the chunks are in now."""
        src = np.frombuffer(self.payload, dtype=np.uint8)
        with ExitStack() as pins:
            pages = [_payload_pages(pins.enter_context(self.tier.pinned(k.id))) for k in self.keys]
            get_limit = memcpy_limit([pair for p, dst in zip(pages, self.dsts) for pair in _pairs(dst, p)])
            put_limit = memcpy_limit([pair for p in pages for pair in _pairs(src, p, reverse=True)])
        return get_limit, put_limit

    def round(self, r: int) -> dict:
        """Ours between two measurements of the limits (on the pages the previous round's puts
        wrote, then on this round's; the first round only after), each configuration's best
        kept: memory's speed drifts within a round, and a limit measured once at a slow moment
        was beaten by more than 5% by a copy of ours at a fast one."""
        limits = [self._limits()] if r else []  # the first round has no pages written before it
        put, get = self._ours()
        limits.append(self._limits())
        return {"put_gbps": put, "get_gbps": get, "get_limit": best_over([g for g, _ in limits]),
                "put_limit": best_over([p for _, p in limits])}


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


class DiskBench:
    """The disk tier's put (written and synced) and cold get, against raw reads of its files.
    Opened first, so that an unusable ``--dir`` fails before any measuring."""

    def __init__(self, keys, headers, payload, args, path) -> None:
        from kvstore.blob import HEADER_BYTES

        self.keys, self.headers, self.payload = keys, headers, payload
        self.tier = DiskTier(path, 2 * len(keys) * (len(payload) + 8192), read_threads=args.read_threads)
        if args.read_form != "buffered":  # auto: as a Store decides, with the probe's figures for this device
            self.tier.o_direct = (args.read_form == "direct"
                                  or read_form(str(self.tier.root), None, TMP_SUFFIX, HASH_SLICE_BYTES)[0])
        self.read_form, self.read_threads = args.read_form, args.read_threads
        self.files = [str(self.tier.path_of(k.id)) for k in keys]
        self.total = len(keys) * len(payload)
        self.blob_bytes = len(payload) + HEADER_BYTES
        ring = [(bytearray(HEADER_BYTES), _prefaulted(len(payload))) for _ in range(2 * args.read_threads)]
        self.outs = [[memoryview(h), memoryview(p)] for h, p in (ring[i % len(ring)] for i in range(len(keys)))]

    def __enter__(self) -> "DiskBench":
        return self

    def __exit__(self, *exc) -> None:
        self.tier.close()

    def _put(self) -> float:
        for k in self.keys:
            self.tier.delete(k.id)
        os.sync()
        t = time.perf_counter()
        for k, h in zip(self.keys, self.headers):
            self.tier.write(k.id, [h, self.payload])
        os.sync()
        return time.perf_counter() - t

    def _get(self) -> float:
        drop_cache(self.files)
        t = time.perf_counter()
        sizes = self.tier.read_many_into([k.id for k in self.keys], self.outs)
        elapsed = time.perf_counter() - t
        if sizes != [self.blob_bytes] * len(self.keys):
            raise RuntimeError("disk tier read back the wrong sizes")
        return self.total / elapsed / GB

    def round(self, r: int) -> dict:
        """A put (no limit: its files are what the get and the limit read), then the cold get
        and the raw reads of the same files in turns."""
        put_s = self._put()
        get, limit = in_turns(r, self._get, lambda: disk_read_limit(self.files))
        return {"put_gbps": self.total / put_s / GB, "get_gbps": get, "get_limit": limit,
                "read_form": self.read_form, "read_threads": self.read_threads}


class StoreBench:
    """Host RAM holds every chunk (the put burst fits in it); the last quarter are read from
    it, the rest cold from disk (dropped from host RAM before each cold read). Each round
    deletes every chunk first, so its burst puts them all anew."""

    def __init__(self, ns, keys, chunk, args, path) -> None:
        import torch

        from kvstore.blob import HEADER_BYTES
        from kvstore.store import Store

        blob = chunk.numel() * chunk.element_size() + HEADER_BYTES
        cfg = StoreConfig(
            host=HostTierConfig(capacity_bytes=len(keys) * (blob + (256 << 10))),
            disk=DiskTierConfig(path=path, capacity_bytes=2 * len(keys) * (blob + 8192),
                                o_direct=READ_FORMS[args.read_form], read_threads=args.read_threads),
        )
        self.keys, self.chunk = keys, chunk
        self.payload_bytes = chunk.numel() * chunk.element_size()
        self.store = Store(cfg)
        resident = max(2, len(keys) // 4)
        self.in_host, self.cold = keys[-resident:], keys[:-resident]
        self.durable = keys[: max(1, len(keys) // 4)]
        self.outs = [torch.zeros_like(chunk) for _ in self.cold]  # reused staging buffers, as a connector has
        direct = getattr(self.store.tier("disk"), "o_direct", False)
        self.form = f"{'O_DIRECT' if direct else 'buffered'}, {self.store.fetch_workers['disk']} in flight"
        self.cold_files = [str(self.store.tier("disk").path_of(k.id)) for k in self.cold]

    def __enter__(self) -> "StoreBench":
        return self

    def __exit__(self, *exc) -> None:
        self.store.close()

    def _host_get(self) -> None:
        for k, out in zip(self.in_host, self.outs):
            self.store.get_into(k, out)

    def _cold_get(self) -> float:
        self.store.drop(self.cold, "host")  # a cold get promotes what it read
        drop_cache(self.cold_files)
        t = time.perf_counter()
        got = list(self.store.stream(self.cold, outs=self.outs))
        elapsed = time.perf_counter() - t
        if len(got) != len(self.cold):
            raise RuntimeError("store lost chunks during the benchmark")
        return len(self.cold) * self.payload_bytes / elapsed / GB

    def round(self, r: int) -> dict:
        store, nbytes = self.store, len(self.keys) * self.payload_bytes
        store.delete(self.keys)
        put_ms = []
        t = time.perf_counter()
        for k in self.keys:  # each put returns once its chunk is in host RAM
            started = time.perf_counter()
            store.put(k, self.chunk)
            put_ms.append((time.perf_counter() - started) * 1e3)
        put_s = time.perf_counter() - t
        store.flush()
        flushed_s = time.perf_counter() - t
        host_s = best_time(self._host_get)
        # raw reads of the same files just before the cold get and just after it: the disk's
        # speed drifts within seconds, and one read of the limit beside ours was beaten by 6%
        before = disk_read_limit(self.cold_files)
        cold = self._cold_get()
        cold_limit = best_over([before, disk_read_limit(self.cold_files)])
        store.delete(self.durable)
        durable_s = _timed(lambda: [store.put(k, self.chunk, durable=True) for k in self.durable])
        return {
            "put_gbps": nbytes / put_s / GB,
            "put_p50_ms": float(np.percentile(put_ms, 50)),
            "put_p99_ms": float(np.percentile(put_ms, 99)),
            "put_ms": put_ms,
            "put_and_flush_gbps": nbytes / flushed_s / GB,
            "host_get_gbps": len(self.in_host) * self.payload_bytes / host_s / GB,
            "cold_disk_get_gbps": cold,
            "durable_put_gbps": len(self.durable) * self.payload_bytes / durable_s / GB,
            "durable_put_ms": durable_s / len(self.durable) * 1e3,
            "cold_get_own_files_limit": cold_limit,
            "cold_get_form": self.form,
        }


def _print_table(report: dict) -> None:
    def spread(section: dict, key: str, digits: int = 2) -> str:
        return Spread.from_dict(section["spread"][key]).format(digits)

    mb = report["chunk_bytes"] / 2**20
    print(f"chunk {mb:.2f} MiB x {report['chunks']} chunks, {len(report['rounds'])} rounds of ours and the limits "
          f"in turns: median (min-max) over the rounds; a ratio is the median of the per-round ratios")
    print(f"{'tier':<6} {'put GB/s':>20} {'get GB/s':>20} {'limit GB/s':>20} {'limit':>9} {'get/limit':>17}  "
          f"limit's configuration (best in most rounds)")
    for name, r in report["tiers"].items():
        print(f"{name:<6} {spread(r, 'put_gbps'):>20} {spread(r, 'get_gbps'):>20} {spread(r, 'limit_gbps'):>20} "
              f"{r['limit']:>9} {spread(r, 'get_vs_limit'):>17}  {r['limit_config']}")
    host = report["tiers"]["host"]
    print(f"host put limit: memcpy into the pool {Spread.from_dict(host['put_limit']).format()} "
          f"GB/s ({host['put_limit']['config']}); put/limit {spread(host, 'put_vs_limit')}")
    s = report["store"]
    print(f"store  put {spread(s, 'put_gbps')} GB/s = {spread(s, 'put_vs_memcpy')}x memcpy into the pool, into host "
          f"RAM while the disk copies are written behind ({spread(s, 'put_and_flush_gbps')} GB/s until they are all "
          f"written); a put's P50 {spread(s, 'put_p50_ms', 1)} ms, P99 {spread(s, 'put_p99_ms', 1)} ms, "
          f"P99/P50 {spread(s, 'put_p99_vs_p50')}")
    print(f"store  get from host {spread(s, 'host_get_gbps')} GB/s = {spread(s, 'host_get_vs_memcpy')}x memcpy")
    print(f"store  cold get from disk {spread(s, 'cold_disk_get_gbps')} GB/s ({s['cold_get_form']}) = "
          f"{spread(s, 'cold_disk_get_vs_raw_read')}x raw read (the best of its round's, of the disk tier's files or "
          f"its own; {s['cold_get_limit']['config']} in most rounds)")
    print(f"store  durable put {spread(s, 'durable_put_gbps')} GB/s ({spread(s, 'durable_put_ms', 1)} ms a chunk: "
          f"written and fsync'ed on disk before it returns)")
    for line in over_limit_lines(report["over_limit"]):
        print(line)
