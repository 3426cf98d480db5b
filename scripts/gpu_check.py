"""Check the compiled Triton kernels against their torch references on a GPU, then measure
paged decode attention's memory bandwidth as a fraction of the GPU's peak; then run the
engine on the GPU with the KV connector (sync and layer-wise loads, a store with host RAM
and disk, and one with the GPU tier) and check its outputs equal the engine's without a store;
last, time chunk loads from the store's host RAM into a GPU paged cache, each way the
connector's loader can move them, against a pinned host -> device copy.

CI has no GPU, so the kernels only ever run there under the Triton interpreter; run this by
hand where a GPU is lent:

    python scripts/gpu_check.py results.json [--peak-gbps 4800] [--quick]

Prints a table and writes every number to the JSON path. Exit status: 0 all checks pass,
1 a kernel or the connector disagrees with its reference, 2 no CUDA GPU or no triton
(nothing is run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in a checkout

from kernels import block_copy, cache_write, paged_attention, quant  # noqa: E402
from kernels._triton import use_triton  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16


SHAPES = [
    ModelShape("smollm2-135m", layers=30, q_heads=9, kv_heads=3, head_dim=64),
    ModelShape("llama-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128),
]
DTYPES = [torch.float16, torch.bfloat16]
# (batch, context tokens) per decode step: the smallest reads 200 MB of KV, several times an
# H100/H200 L2 cache, so the timing measures DRAM rather than cache or launch overhead
BANDWIDTH_CASES = [(64, 4096), (128, 8192)]
QUICK_BANDWIDTH_CASES = [(64, 4096)]
# max |triton - reference| for attention outputs (the kernel's half-precision dots run in tf32:
# half K/V are exact there, the scaled query and the probabilities are rounded to 10 bits);
# copies and quantised bytes must be exact
ATTENTION_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass
class Check:
    op: str
    shape: str
    dtype: str
    max_abs_err: float
    tolerance: float
    ok: bool


@dataclass
class Bandwidth:
    shape: str
    dtype: str
    batch: int
    context: int
    kv_bytes: int
    time_s: float
    gbps: float
    fraction_of_peak: float | None


def peak_gbps(props, override: float | None = None) -> tuple[float | None, str]:
    """Peak DRAM bandwidth in GB/s and where it came from: the flag wins, else the device's
    memory clock (kHz) and bus width (bits), double data rate; None when neither is known."""
    if override:
        return float(override), "--peak-gbps"
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "device properties (memory clock x bus width x 2)"
    return None, "unknown (pass --peak-gbps)"


def kv_bytes_read(context_lens: list[int], kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V one decode step must read: every cached token of every sequence, once."""
    return 2 * sum(context_lens) * kv_heads * head_dim * itemsize


def format_table(rows: list[dict]) -> str:
    """A plain fixed-width table of dict rows (same keys), floats to 4 significant digits."""
    if not rows:
        return "(none)"
    cols = list(rows[0])
    cell = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cell)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, width))]
    lines.append("  ".join("-" * w for w in width))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, width)) for row in cell]
    return "\n".join(lines)


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item() if got.numel() else 0.0


def random_paged_cache(shape: ModelShape, dtype, context_lens: list[int], gen: torch.Generator, device):
    """One layer's K and V caches with shuffled block tables covering ``context_lens``."""
    bs = shape.block_size
    per_seq = max(-(-n // bs) for n in context_lens)
    num_blocks = len(context_lens) * per_seq
    cache = torch.randn(2, num_blocks, bs, shape.kv_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).reshape(len(context_lens), per_seq)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return cache[0], cache[1], tables.to(torch.int32), lens


# decode context lengths checked: ones that are and are not multiples of the block size
CHECK_CONTEXTS = (1, 15, 16, 17, 100, 511, 1000, 1024)


def check_shape(shape: ModelShape, dtype, device, contexts=CHECK_CONTEXTS) -> list[Check]:
    """Every Triton op against its reference on one model shape and dtype."""
    gen = torch.Generator(device=device).manual_seed(0)
    checks = []

    def record(op, err, tol):
        checks.append(Check(op, shape.name, str(dtype).removeprefix("torch."), err, tol, err <= tol))

    k, v, tables, lens_t = random_paged_cache(shape, dtype, list(contexts), gen, device)
    query = torch.randn(len(contexts), shape.q_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    scale = shape.head_dim**-0.5
    got = paged_attention.paged_decode_attention_triton(query, k, v, tables, lens_t, scale)
    want = paged_attention.paged_decode_attention_torch(query, k, v, tables, lens_t, scale)
    record("paged_decode_attention", _max_err(got, want), ATTENTION_TOL[dtype])
    # the engine calls the dispatchers: on these tensors they must pick Triton (1.0 = torch)
    record("dispatch_picks_triton", 0.0 if use_triton(query, k, v, tables, lens_t) else 1.0, 0.0)

    # cache write of one prefill step with padding slots
    tokens = 64
    key = torch.randn(tokens, shape.kv_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(k.shape[0] * shape.block_size, generator=gen, device=device)[:tokens]
    slots[::7] = -1
    caches = [torch.zeros_like(k) for _ in range(4)]
    cache_write.reshape_and_cache_triton(key, value, caches[0], caches[1], slots)
    cache_write.reshape_and_cache_torch(key, value, caches[2], caches[3], slots)
    record("reshape_and_cache", max(_max_err(caches[0], caches[2]), _max_err(caches[1], caches[3])), 0.0)

    # gather a 256-token chunk out of the all-layers cache, scatter it elsewhere
    num_blocks, n = 64, 256 // shape.block_size
    kv = torch.randn(
        shape.layers, 2, num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, generator=gen, device=device
    ).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen, device=device)[:n].to(torch.int32)
    chunk = block_copy.gather_blocks_triton(kv, ids)
    record("gather_blocks", _max_err(chunk, block_copy.gather_blocks_torch(kv, ids)), 0.0)
    dest = torch.randperm(num_blocks, generator=gen, device=device)[:n].to(torch.int32)
    got_kv, want_kv = torch.zeros_like(kv), torch.zeros_like(kv)
    block_copy.scatter_blocks_triton(chunk, got_kv, dest)
    block_copy.scatter_blocks_torch(chunk, want_kv, dest)
    record("scatter_blocks", _max_err(got_kv, want_kv), 0.0)
    # the one-layer variants of a layer-wise load, the chunk viewed past its first block
    layer = shape.layers - 1
    got = block_copy.gather_layer_blocks_triton(kv[layer], ids)
    record("gather_layer_blocks", _max_err(got, block_copy.gather_layer_blocks_torch(kv[layer], ids)), 0.0)
    tail = chunk[layer, :, shape.block_size:]
    got_kv, want_kv = torch.zeros_like(kv), torch.zeros_like(kv)
    block_copy.scatter_layer_blocks_triton(tail, got_kv[layer], dest[1:])
    block_copy.scatter_layer_blocks_torch(tail, want_kv[layer], dest[1:])
    record("scatter_layer_blocks", _max_err(got_kv, want_kv), 0.0)

    # quantisation of that chunk: the kernels promise the CPU reference's bytes exactly
    # (torch on CUDA divides by a scalar as a reciprocal multiply, so it is not the yardstick)
    cpu_chunk = chunk.cpu()
    q, s = quant.quantize_int8_triton(chunk)
    q_ref, s_ref = quant.quantize_int8_torch(cpu_chunk)
    record("quantize_int8", max(_max_err(q.cpu(), q_ref), _max_err(s.cpu(), s_ref)), 0.0)
    deq = quant.dequantize_int8_triton(q, s, dtype)
    record("dequantize_int8", _max_err(deq.cpu(), quant.dequantize_int8_torch(q_ref, s_ref, dtype)), 0.0)
    packed, s4, z4 = quant.quantize_int4_triton(chunk, 32)
    p_ref, s4_ref, z4_ref = quant.quantize_int4_torch(cpu_chunk, 32)
    err = max(_max_err(packed.cpu(), p_ref), _max_err(s4.cpu(), s4_ref), _max_err(z4.cpu(), z4_ref))
    record("quantize_int4", err, 0.0)
    deq4 = quant.dequantize_int4_triton(packed, s4, z4, 32, dtype)
    record("dequantize_int4", _max_err(deq4.cpu(), quant.dequantize_int4_torch(p_ref, s4_ref, z4_ref, 32, dtype)), 0.0)
    return checks


def check_connector(device, workdir: Path) -> tuple[list[Check], dict]:
    """The engine on ``device`` with the connector: greedy outputs with KV loaded from a store
    (sync and layer-wise; host RAM + disk, and with the GPU tier) equal the engine's without
    one (``max_abs_err`` counts differing requests); figures: what was loaded, and how fast."""
    from connector import ConnectorConfig
    from engine import LLM, EngineConfig, SamplingParams
    from engine.testing import make_tiny_checkpoint
    from kvstore.config import DiskTierConfig, GpuTierConfig, HostTierConfig, StoreConfig
    from kvstore.store import Store

    model = make_tiny_checkpoint(workdir / "tiny", "llama", num_layers=4)
    base = LLM(model, EngineConfig(num_blocks=256, block_size=16, dtype="float32", device=str(device),
                                   max_num_batched_tokens=1024))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (256, 300, 480, 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.output_token_ids for o in base.generate(prompts, params)]
    checks, figures = [], {"kvikio_installed": importlib.util.find_spec("kvikio") is not None,
                           "kvikio_used": False, "staging": "pinned host buffers" if device.type == "cuda" else "host"}
    stores = {"host+disk": {}, "gpu tier": {"gpu": GpuTierConfig(enabled=device.type == "cuda", device=str(device))}}
    for name, extra in stores.items():
        for mode in ("sync", "layerwise"):
            cfg = StoreConfig(host=HostTierConfig(capacity_bytes=256 << 20),
                              disk=DiskTierConfig(path=str(workdir / f"{name}-{mode}".replace(" ", "-"))), **extra)
            with Store(cfg) as store:
                connector = ConnectorConfig(chunk_tokens=64, load_mode=mode)
                with base.with_config(kv_store=store, connector=connector) as cold:
                    cold.generate(prompts, params)
                    cold.flush_saves()
                with base.with_config(kv_store=store, connector=connector) as warm:
                    got = [o.output_token_ids for o in warm.generate(prompts, params)]
                    stats = warm.stats().connector
            wrong = sum(g != w for g, w in zip(got, want))
            checks.append(Check(f"connector outputs ({mode})", f"tiny, {name}", "float32", float(wrong), 0.0, wrong == 0))
            figures[f"{name}, {mode}"] = {"loaded_tokens": stats.loaded_tokens, "loaded_bytes": stats.loaded_bytes,
                                          "load_s": stats.load_s,
                                          "load_gbps": stats.loaded_bytes / stats.load_s / 1e9 if stats.load_s else 0.0}
    return checks, figures


@dataclass
class LoadRate:
    path: str
    threads: int
    chunk_bytes: int
    chunks: int
    gbps: float
    fraction_of_pinned_copy: float


def measure_chunk_loads(device, shape: ModelShape = SHAPES[1], dtype=torch.float16, chunk_tokens: int = 256,
                        chunks: int = 64, threads=(1, 2, 4), rounds: int = 3) -> list[LoadRate]:
    """Chunks of ``shape`` from a store's host RAM into a paged KV cache on ``device``, each
    way the connector's loader threads can move them: ``get_into`` a pinned staging buffer,
    then a host -> device copy and the scatter kernel on the thread's stream; borrowing the
    store's pages unregistered (one copy fewer, but from pageable memory); borrowing them
    once ``prepare_lending`` registered them with CUDA (what the connector does on a GPU).
    Against a bare host -> device copy of the same bytes from pinned memory, the machine's
    limit. Median of ``rounds``."""
    from connector.metadata import ChunkLoad
    from connector.staging import StagingPool
    from connector.transfer import ChunkMover
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
    from kvstore.keys import Namespace, chunk_keys
    from kvstore.store import Store

    blocks = chunk_tokens // shape.block_size
    ns = Namespace("gpu-check", shape.layers, shape.kv_heads, shape.head_dim, dtype=str(dtype).removeprefix("torch."),
                   chunk_tokens=chunk_tokens)
    keys = chunk_keys(list(range(chunks * chunk_tokens)), ns)
    chunk_shape = (shape.layers, 2, chunk_tokens, shape.kv_heads, shape.head_dim)
    kv_cache = torch.zeros(shape.layers, 2, chunks * blocks, shape.block_size, shape.kv_heads, shape.head_dim,
                           dtype=dtype, device=device)
    mover = ChunkMover(kv_cache)
    loads = [ChunkLoad(k, tuple(range(i * blocks, (i + 1) * blocks))) for i, k in enumerate(keys)]
    chunk_bytes = ns.chunk_bytes
    rates = []

    def rate(path, nthreads, seconds, limit):
        gbps = chunk_bytes * chunks / seconds / 1e9
        rates.append(LoadRate(path, nthreads, chunk_bytes, chunks, gbps, gbps / limit if limit else 1.0))

    pin = device.type == "cuda"
    seconds = _pinned_copy_seconds(chunk_shape, dtype, device, chunks, rounds)
    limit = chunk_bytes * chunks / seconds / 1e9
    rate("pinned host -> device copy (limit)", 1, seconds, limit)

    with Store(StoreConfig(host=HostTierConfig(capacity_bytes=2 * chunks * chunk_bytes + (16 << 20)),
                           disk=DiskTierConfig(enabled=False))) as store:
        gen = torch.Generator().manual_seed(3)
        for k in keys:
            store.put(k, torch.randn(chunk_shape, generator=gen).to(dtype))

        def borrowed(load):
            with store.borrow(load.key) as src:
                if src is None:
                    raise AssertionError("the store did not lend a chunk it holds raw in host RAM")
                mover.scatter(src, load)

        for nthreads in threads:
            staging = StagingPool(chunk_shape, dtype, pin_memory=pin, keep=nthreads, prefault=nthreads)

            def staged(load):
                buf = staging.take()
                assert store.get_into(load.key, buf)
                mover.scatter(buf, load)
                staging.give(buf)

            paths = [("get_into pinned staging + scatter", staged)]
            paths += [("borrow pageable + scatter", borrowed)] if pin else []
            for path, fn in paths:
                rate(path, nthreads, _median_wall(fn, loads, nthreads, rounds), limit)
        if not store.prepare_lending(device):
            raise AssertionError(f"the store could not make its host RAM a DMA source for {device}")
        for nthreads in threads:
            rate("borrow registered + scatter (prepare_lending)", nthreads,
                 _median_wall(borrowed, loads, nthreads, rounds), limit)
        want = torch.stack([store.get([k])[0] for k in keys[-2:]]).to(device)
        got = torch.stack([kv_cache[:, :, b.block_ids[0]:b.block_ids[-1] + 1].flatten(2, 3) for b in loads[-2:]])
        if not torch.equal(got, want):
            raise AssertionError("a chunk loaded into the GPU cache differs from the store's")
    return rates


def measure_daemon_loads(device, workdir: Path, shape: ModelShape = SHAPES[1], dtype=torch.float16,
                         chunk_tokens: int = 256, chunks: int = 64, load_workers: int = 4, rounds: int = 5,
                         chunks_per_read: Sequence[int] = (2, 8), slot_bytes: int | None = None) -> list[LoadRate]:
    """Chunks from a daemon on this host into a paged KV cache on ``device``, as the connector
    loads them (connector/loads.py, ``load_workers`` loader threads): staged (read into pinned
    buffers, then copied; 2 chunks a read call, the connector's default) and handed over from
    the daemon's shared memory (registered with CUDA by ``hands_over_in_place(device)``) with
    each of ``chunks_per_read``, rounds interleaved; against a pinned host -> device copy of
    the same bytes. Medians of ``rounds``. The daemon's slots are its defaults (64 of 8 MiB,
    smaller than a llama-8b chunk) unless ``slot_bytes`` is given (16 of that size)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from connector.availability import Availability
    from connector.loads import LoadTask
    from connector.metadata import ChunkLoad, RequestLoad
    from connector.staging import StagingPool
    from connector.transfer import ChunkMover
    from kvstore.client import Client
    from kvstore.daemon.spawn import DaemonProcess
    from kvstore.keys import Namespace, chunk_keys

    blocks = chunk_tokens // shape.block_size
    ns = Namespace("gpu-check", shape.layers, shape.kv_heads, shape.head_dim, dtype=str(dtype).removeprefix("torch."),
                   chunk_tokens=chunk_tokens)
    keys = chunk_keys(list(range(chunks * chunk_tokens)), ns)
    total = ns.chunk_bytes * chunks
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "token").write_text("gpu-check-token\n")
    shm = "" if slot_bytes is None else f'[shm]\nslots = 16\nslot_bytes = {slot_bytes}\n'
    (workdir / "daemon.toml").write_text(
        f'{shm}[store.host]\ncapacity_bytes = {2 * total + (64 << 20)}\npage_bytes = {256 << 10}\n'
        f'[store.disk]\nenabled = false\n')
    daemon = DaemonProcess(["--config", str(workdir / "daemon.toml"), "--listen", "127.0.0.1:0",
                            "--data-dir", str(workdir / "data"), "--auth-token-file", str(workdir / "token")])
    try:
        with Client(daemon.addr, token_file=str(workdir / "token")) as client:
            gen = torch.Generator().manual_seed(4)
            for key in keys:
                client.put(key, torch.randn(ns.chunk_shape, generator=gen).to(dtype))
            kv_cache = torch.zeros(shape.layers, 2, chunks * blocks, shape.block_size, shape.kv_heads,
                                   shape.head_dim, dtype=dtype, device=device)
            mover = ChunkMover(kv_cache)
            staging = StagingPool(ns.chunk_shape, dtype, device.type == "cuda", keep=2 * load_workers,
                                  prefault=2 * load_workers)
            request = RequestLoad("gpu-check", 0, [ChunkLoad(k, tuple(range(i * blocks, (i + 1) * blocks)))
                                                   for i, k in enumerate(keys)])
            cond = threading.Condition()
            if not client.hands_over_in_place(device):
                raise AssertionError(f"the client cannot hand chunks over to {device} from shared memory")

            def load(handed_over: bool, per_read: int) -> float:
                task = LoadTask(request, client, staging, mover, Availability(30), cond, chunks_per_read=per_read,
                                timeout_s=120, layerwise=False)
                task.hands_over = handed_over  # the measurement's choice, not the load's
                kv_cache.zero_()
                start = time.perf_counter()
                task.submit(pool, here=True)
                with cond:
                    task.wait()
                    loaded = task.finish().loaded_chunks
                seconds = time.perf_counter() - start
                if loaded != chunks or not torch.equal(
                        kv_cache[:, :, -blocks:].flatten(2, 3).cpu(), client.get(keys[-1:])[0]):
                    raise AssertionError("a chunk loaded from the daemon differs from what it holds")
                return seconds

            ways = [(False, 2)] + [(True, n) for n in chunks_per_read]
            times = {way: [] for way in ways}
            with ThreadPoolExecutor(load_workers) as pool:
                for _ in range(rounds):
                    for way in ways:
                        times[way].append(load(*way))
    finally:
        daemon.stop()
    limit = total / _pinned_copy_seconds(ns.chunk_shape, dtype, device, chunks, rounds) / 1e9
    rates = [LoadRate("pinned host -> device copy (limit)", 1, ns.chunk_bytes, chunks, limit, 1.0)]
    for way in ways:
        handed_over, per_read = way
        path = (f"daemon: handed over from registered shared memory, {per_read} chunks a read" if handed_over
                else "daemon: read into pinned staging + scatter")
        gbps = total / statistics.median(times[way]) / 1e9
        rates.append(LoadRate(path, load_workers, ns.chunk_bytes, chunks, gbps, gbps / limit))
    return rates


def _pinned_copy_seconds(chunk_shape, dtype, device, chunks: int, rounds: int) -> float:
    """Median seconds of ``chunks`` host -> device copies of a chunk from pinned memory."""
    pin = device.type == "cuda"
    pinned = torch.empty(chunk_shape, dtype=dtype, pin_memory=pin)
    target = torch.empty(chunk_shape, dtype=dtype, device=device)

    def copies():
        for _ in range(chunks):
            target.copy_(pinned, non_blocking=True)
        if pin:
            torch.cuda.synchronize(device)

    copies()
    return statistics.median(_wall(copies) for _ in range(rounds))


def _median_wall(fn, items, nthreads: int, rounds: int) -> float:
    """Median seconds of ``fn`` over every item on ``nthreads`` threads, after one warm-up."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(nthreads) as pool:
        def run():
            list(pool.map(fn, items))
        run()
        return statistics.median(_wall(run) for _ in range(rounds))


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_kernel(fn, warmup: int, iters: int, rounds: int = 5) -> float:
    """Seconds per call: CUDA events around ``iters`` back-to-back calls (so the GPU queue stays
    full and Python launch overhead hides behind the kernels), median over ``rounds``; the
    warm-up calls absorb compilation."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def measure_bandwidth(shape: ModelShape, dtype, batch: int, context: int, peak: float | None, iters: int, device):
    gen = torch.Generator(device=device).manual_seed(1)
    k, v, tables, lens = random_paged_cache(shape, dtype, [context] * batch, gen, device)
    query = torch.randn(batch, shape.q_heads, shape.head_dim, generator=gen, device=device).to(dtype)
    scale = shape.head_dim**-0.5
    seconds = time_kernel(
        lambda: paged_attention.paged_decode_attention_triton(query, k, v, tables, lens, scale), 3, iters
    )
    nbytes = kv_bytes_read([context] * batch, shape.kv_heads, shape.head_dim, k.element_size())
    gbps = nbytes / seconds / 1e9
    return Bandwidth(
        shape.name, str(dtype).removeprefix("torch."), batch, context, nbytes, seconds, gbps,
        gbps / peak if peak else None,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path", type=Path, help="where to write the results as JSON")
    parser.add_argument(
        "--peak-gbps", type=float, default=None, help="peak DRAM bandwidth in GB/s (else from the device)"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per bandwidth case")
    parser.add_argument("--quick", action="store_true", help="one bandwidth case per shape and dtype")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible to torch; this script only runs on a GPU machine", file=sys.stderr)
        return 2
    if importlib.util.find_spec("triton") is None:
        print("gpu_check: triton is not installed (pip install 'kvstore[gpu]')", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    peak, peak_source = peak_gbps(props, args.peak_gbps)
    print(f"device: {props.name}; peak bandwidth: {peak if peak is None else round(peak, 1)} GB/s from {peak_source}")

    checks = [c for shape in SHAPES for dtype in DTYPES for c in check_shape(shape, dtype, device)]
    print("\ncorrectness (Triton vs torch reference)\n" + format_table([asdict(c) for c in checks]))

    cases = QUICK_BANDWIDTH_CASES if args.quick else BANDWIDTH_CASES
    bandwidth = [
        measure_bandwidth(shape, dtype, batch, context, peak, args.iters, device)
        for shape in SHAPES for dtype in DTYPES for batch, context in cases
    ]
    print("\npaged decode attention, one layer (KV bytes read / kernel time)\n"
          + format_table([asdict(b) for b in bandwidth]))

    with tempfile.TemporaryDirectory() as tmp:
        connector_checks, connector_figures = check_connector(device, Path(tmp))
    print("\nthe engine with the KV connector on the GPU (outputs vs no store)\n"
          + format_table([asdict(c) for c in connector_checks]))
    print(json.dumps(connector_figures, indent=2))

    loads = measure_chunk_loads(device)
    with tempfile.TemporaryDirectory() as tmp:
        loads += measure_daemon_loads(device, Path(tmp))
    print("\nchunk loads into the GPU's paged KV cache (llama-8b chunks of 256 tokens, fp16)\n"
          + format_table([asdict(r) for r in loads]))

    ok = all(c.ok for c in checks + connector_checks)
    result = {
        "device": props.name,
        "peak_gbps": peak,
        "peak_source": peak_source,
        "ok": ok,
        "checks": [asdict(c) for c in checks],
        "bandwidth": [asdict(b) for b in bandwidth],
        "connector": {"checks": [asdict(c) for c in connector_checks], "figures": connector_figures},
        "chunk_loads": [asdict(r) for r in loads],
    }
    args.json_path.write_text(json.dumps(result, indent=2))
    print(f"\n{'all checks pass' if ok else 'SOME CHECKS FAILED'}; results written to {args.json_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
