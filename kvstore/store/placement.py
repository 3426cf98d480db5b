"""Joint compression and eviction: when a tier needs room, its eviction victim either stays
there re-encoded smaller or leaves (lower tiers keep their copies).

The tier's policy picks the victim, the chunk it expects least of; placement picks what
becomes of it. Every option is valued in seconds saved per expected use of the chunk:

    gain(T, c) = fallback_s - load_s(T, c) - quality_weight_s x |perplexity change of c, %|

``fallback_s`` is what serving the chunk costs without this copy: loading the fastest other
replica, or recomputing its tokens (the prefill cost model). ``load_s(T, c)`` is the blob's
bytes over T's measured read bandwidth plus c's measured decode time. The quality cost is
paid on every use, like the time saved, so both scale with the policy's expected reuse.
The victim is re-encoded into the candidate with the highest ``reuse x gain / bytes`` when
that beats what a typical chunk (reuse 1) earns per byte stored raw in T, the price of a
byte there; otherwise it is dropped. Each later eviction of the same chunk plans again: a
still smaller encoding, or out. Model and parameters: docs/placement.md.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvstore.blob import DTYPE_NAMES, HEADER_BYTES
from kvstore.codecs import Codec, get_codec
from kvstore.config import PlacementConfig
from kvstore.keys import DTYPES

VERDICT_SCHEMA = "kvstore.codec-verdicts/2"
log = logging.getLogger(__name__)

UNMATCHED_VERDICT_SCHEMA = "kvstore.codec-verdicts/1"  # named no model id: refused, never applied to every model
PROFILE_DECODES = 3  # decode timing: best of this many, so one slow first call does not decide


@dataclass(frozen=True)
class CodecProfile:
    """How a codec does on chunks of one shape and dtype, measured once."""

    payload_ratio: float  # payload bytes / raw tensor bytes
    decode_s: float  # seconds to decode one chunk


@dataclass(frozen=True)
class Choice:
    codec: Codec
    footprint: int  # expected bytes of the tier's capacity the re-encoded blob takes
    utility_per_byte: float  # reuse x gain / footprint, seconds per byte


def load_verdicts(paths: list[str]) -> dict[tuple[str, str], dict[str, float]]:
    """``{(model id, dtype): {codec name: |perplexity change %|}}`` for the codecs each file
    allows. A verdict holds only for the model it was measured on, so it is keyed by the
    namespace model id the file names, never applied to another model's chunks."""
    allowed: dict[tuple[str, str], dict[str, float]] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"placement.verdicts: cannot read {path}: {exc}") from None
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema == UNMATCHED_VERDICT_SCHEMA:
            raise ValueError(f"placement.verdicts: {path} is a {schema} file, which does not name the model id its "
                             f"verdicts hold for; re-run `kvbench probe-codec` on that model to write a {VERDICT_SCHEMA} one")
        if schema != VERDICT_SCHEMA:
            raise ValueError(f"placement.verdicts: {path} is not a {VERDICT_SCHEMA} file")
        model_id, dtype = data.get("model_id"), data.get("dtype")
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"placement.verdicts: {path} names no model_id")
        if dtype not in DTYPES:
            raise ValueError(f"placement.verdicts: {path} has dtype {dtype!r}, not one of {DTYPES}")
        if (model_id, dtype) in allowed:
            raise ValueError(f"placement.verdicts: two files give verdicts for {model_id} in {dtype}")
        allowed[(model_id, dtype)] = {
            name: abs(float(v["ppl_change_pct"]))
            for name, v in data.get("codecs", {}).items()
            if v.get("allowed") is True and "ppl_change_pct" in v
        }
    return allowed


def planned_read_bytes_per_s(config: PlacementConfig, tier_name: str, measured_gbps: float) -> float:
    """The bandwidth to plan with for a tier: the configured one, else the measured one,
    else the assumed one."""
    configured = getattr(config, f"{tier_name}_read_bytes_per_s", 0)
    if configured:
        return float(configured)
    return measured_gbps * 1e9 if measured_gbps > 0 else float(config.assumed_read_bytes_per_s)


class Placement:
    def __init__(self, config: PlacementConfig) -> None:
        if config.quality_weight_s < 0 or config.prefill_tokens_per_s <= 0 or config.assumed_read_bytes_per_s <= 0:
            raise ValueError("placement: quality_weight_s must be >= 0, prefill_tokens_per_s and "
                             "assumed_read_bytes_per_s positive")
        self.config = config
        try:
            self._codecs = [get_codec(name) for name in config.codecs]
        except KeyError as exc:
            raise ValueError(f"placement.codecs: {exc.args[0]}") from None
        self._quality = load_verdicts(config.verdicts)
        self._profiles: dict[tuple[torch.dtype, tuple[int, ...]], dict[int, CodecProfile]] = {}
        self._profiling: set[tuple[torch.dtype, tuple[int, ...]]] = set()  # asked for, not measured yet
        self._profiling_done = threading.Condition()
        self._profiler = ThreadPoolExecutor(1, thread_name_prefix="codec-profile")

    @property
    def inert(self) -> bool:
        """No chunk of any model or dtype can have a candidate: nothing for placement to decide."""
        return not any(c.lossless or any(c.name in allowed for allowed in self._quality.values())
                       for c in self._codecs)

    def candidates(self, model_id: str | None, dtype: torch.dtype) -> list[Codec]:
        """Lossless codecs always; a lossy one only where a verdict measured on ``model_id``
        allows it for ``dtype``. A chunk of no known model (None) gets lossless ones only."""
        allowed = self._quality.get((model_id, DTYPE_NAMES[dtype]), {})
        return [c for c in self._codecs if c.lossless or c.name in allowed]

    def quality_loss(self, codec: Codec, model_id: str | None, dtype: torch.dtype) -> float:
        """The codec's |perplexity change| in percent on that model (0 for lossless codecs)."""
        return 0.0 if codec.lossless else self._quality[(model_id, DTYPE_NAMES[dtype])][codec.name]

    def _measured(self, dtype: torch.dtype) -> list[Codec]:
        """The codecs some model's chunks of ``dtype`` may take: what profiling measures."""
        allowed = {name for (_, d), codecs in self._quality.items() if d == DTYPE_NAMES[dtype] for name in codecs}
        return [c for c in self._codecs if c.lossless or c.name in allowed]

    def recompute_s(self, shape: tuple[int, ...]) -> float:
        """Prefill cost model: a chunk ``[layers, 2, tokens, heads, head_dim]`` costs its tokens."""
        return shape[2] / self.config.prefill_tokens_per_s

    def read_bytes_per_s(self, tier_name: str, measured_gbps: float) -> float:
        return planned_read_bytes_per_s(self.config, tier_name, measured_gbps)

    def profiled(self, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
        return (dtype, shape) in self._profiles

    def profile_soon(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Start ``profile(dtype, shape)`` on a background thread unless it ran or runs: a
        put of a new shape never measures codecs itself. Decisions that need the profile
        wait for it (``wait_profiles``) instead of deciding without it."""
        wanted = (dtype, tuple(shape))
        if wanted in self._profiles:
            return
        with self._profiling_done:
            if wanted in self._profiles or wanted in self._profiling:
                return
            self._profiling.add(wanted)
        self._profiler.submit(self._profile_logged, *wanted)

    def _profile_logged(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        try:
            self.profile(dtype, shape)
        except Exception:  # noqa: BLE001 - a background task has no caller to raise to
            log.exception("placement: profiling the codecs on %s%s failed; its chunks stay as put", dtype, list(shape))
        with self._profiling_done:
            self._profiling.discard((dtype, shape))
            self._profiling_done.notify_all()

    def wait_profiles(self) -> None:
        """Wait until no profile asked for is still being measured (call without any lock
        held): eviction and copies written behind then decide as if it had been measured
        before the put that asked for it, and a put that needs no room never waits."""
        if not self._profiling:
            return
        with self._profiling_done:
            while self._profiling:
                self._profiling_done.wait()

    def close(self) -> None:
        """Stop the profiling thread (a profile running finishes first)."""
        self._profiler.shutdown(wait=True)

    def profile(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Measure the size ratio and decode time of every codec a chunk of this shape and
        dtype may take, whatever its model, on a random chunk (once; lossy sizes do not depend
        on the values, and lz4 barely shrinks real fp16 KV either). A codec that cannot encode
        the shape (a mixed budget below what its scales take) is no candidate for it."""
        profiles: dict[int, CodecProfile] = {}
        candidates = self._measured(dtype)
        if not candidates:  # nothing to measure (no verdict for this dtype): no sample either
            self._profiles[(dtype, shape)] = profiles
            return
        sample = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        raw_bytes = sample.numel() * sample.element_size()
        for codec in candidates:
            try:
                payload = codec.encode(sample)
            except ValueError:
                continue
            out = torch.empty(shape, dtype=dtype)
            times = []
            for _ in range(PROFILE_DECODES):
                started = time.perf_counter()
                codec.decode_into(payload, out)
                times.append(time.perf_counter() - started)
            decode_s = raw_bytes / self.config.decode_bytes_per_s if self.config.decode_bytes_per_s else min(times)
            profiles[codec.codec_id] = CodecProfile(len(payload) / raw_bytes, decode_s)
        self._profiles[(dtype, shape)] = profiles

    def load_s(
        self, dtype: torch.dtype, shape: tuple[int, ...], blob_bytes: int, codec_id: int | None, read_bytes_per_s: float
    ) -> float:
        """Seconds to serve a blob: its bytes over the tier's bandwidth, plus the codec's
        decode time. Raw blobs are read straight into the caller's buffer, so they (and a
        codec that is not a candidate) count as free to decode."""
        profile = self._profiles[(dtype, shape)].get(codec_id)
        return blob_bytes / read_bytes_per_s + (profile.decode_s if profile else 0.0)

    def choose(
        self,
        model_id: str | None,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        blob_bytes: int,
        reuse: float,
        fallback_s: float,
        read_bytes_per_s: float,
        footprint: Callable[[int], int],
    ) -> Choice | None:
        """The encoding a victim of ``blob_bytes`` should be re-encoded into, or None to drop it.
        ``model_id`` is the chunk's namespace model (None: unknown), whose verdicts apply.

        Needs ``profile(dtype, shape)`` first. ``fallback_s`` is the cost of serving the chunk
        without this copy; ``read_bytes_per_s`` the tier's read bandwidth; ``footprint`` the
        capacity the tier charges for a blob of so many bytes (pages, blocks), which is what
        an encoding must shrink and what utility is counted per.
        """
        raw_blob = HEADER_BYTES + math.prod(shape) * dtype.itemsize
        raw_gain = fallback_s - self.load_s(dtype, shape, raw_blob, 0, read_bytes_per_s)
        price = max(0.0, raw_gain / footprint(raw_blob))
        return self._densest(model_id, dtype, shape, blob_bytes, reuse, fallback_s, read_bytes_per_s, footprint, price)

    def choose_on_write(
        self, model_id: str | None, dtype: torch.dtype, shape: tuple[int, ...], blob_bytes: int,
        read_bytes_per_s: float, footprint: Callable[[int], int], room: bool,
    ) -> Choice | None:
        """The encoding a raw chunk's new copy in a tier should have, or None to write it raw.

        Valued against recomputing (the copy is what saves it once the faster tiers let the
        chunk go), at a typical reuse. With ``room`` in the tier for the raw copy, bytes cost
        nothing yet and the encoding that saves the most time per use wins: raw on a fast
        tier (decoding costs more than the bytes it saves), a smaller one on a tier so slow
        that loading the raw copy costs about what recomputing does. Without room, bytes are
        what the copy displaces, and the most time saved per byte wins, as for a victim.
        The copy is written either way and a hit on it is loaded, so where no encoding beats
        recomputing the least costly one is still the one to write.
        """
        recompute_s = self.recompute_s(shape)

        def merit(gain: float, size: int) -> float:
            return gain if room else gain / footprint(size)

        raw_gain = recompute_s - self.load_s(dtype, shape, blob_bytes, 0, read_bytes_per_s)
        best, best_merit = None, merit(raw_gain, blob_bytes)
        for codec, size, gain in self._shrinking(model_id, dtype, shape, blob_bytes, recompute_s, read_bytes_per_s,
                                                 footprint):
            if merit(gain, size) > best_merit:
                best, best_merit = Choice(codec, footprint(size), gain / footprint(size)), merit(gain, size)
        return best

    def _shrinking(self, model_id, dtype, shape, blob_bytes, fallback_s, read_bytes_per_s, footprint):
        """(codec, encoded blob size, seconds saved per use against ``fallback_s``) of every
        candidate for the model whose blob takes less of the tier than one of ``blob_bytes``."""
        profiles = self._profiles[(dtype, shape)]
        raw_bytes = math.prod(shape) * dtype.itemsize
        for codec in self.candidates(model_id, dtype):
            if codec.codec_id not in profiles:
                continue  # cannot encode this shape
            size = HEADER_BYTES + math.ceil(profiles[codec.codec_id].payload_ratio * raw_bytes)
            if footprint(size) < footprint(blob_bytes):
                load_s = self.load_s(dtype, shape, size, codec.codec_id, read_bytes_per_s)
                quality_s = self.config.quality_weight_s * self.quality_loss(codec, model_id, dtype)
                yield codec, size, fallback_s - load_s - quality_s

    def _densest(self, model_id, dtype, shape, blob_bytes, reuse, fallback_s, read_bytes_per_s, footprint,
                 price) -> Choice | None:
        """The candidate that shrinks a blob of ``blob_bytes`` with the highest ``reuse x gain /
        footprint``, if its gain is positive and that beats ``price``."""
        best: Choice | None = None
        for codec, size, gain in self._shrinking(model_id, dtype, shape, blob_bytes, fallback_s, read_bytes_per_s,
                                                 footprint):
            density = reuse * gain / footprint(size)
            if gain > 0 and density > price and (best is None or density > best.utility_per_byte):
                best = Choice(codec, footprint(size), density)
        return best
