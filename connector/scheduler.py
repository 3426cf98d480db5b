"""The connector's scheduler side: bookkeeping only, never a tensor.

For each request it computes the store's chunk keys from the token ids (they chain over
``chunk_tokens`` tokens, so they differ from the engine's block hashes), answers how many
tokens past the local prefix cache the store can supply, plans the loads once the engine
has allocated blocks, and plans each step's saves of newly completed full chunks, prompt
and output alike, and of each prompt's tail (``connector/tails.py``) once its prefill is
done. Hits are chunk-aligned, plus a tail of whole blocks where one is stored; the engine
applies the last-token rule (a full-prompt hit still computes the last prompt token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from connector.availability import Availability
from connector.config import ConnectorConfig
from connector.metadata import ChunkLoad, ChunkSave, ConnectorMetadata, ConnectorOutput, RequestLoad, RequestSave
from connector.pins import PinLedger
from connector.sessions import TailRegistry, by_namespace
from connector.tails import TailChunk, plan_tail, tail_candidates
from connector.stats import StatsRecorder
from kvstore.api import ChunkStore
from kvstore.keys import ROOT_HASH, ChunkKey, Namespace, prefix_hashes


class Request(Protocol):
    """What this side reads of an engine request (``engine.sequence.Sequence`` has it)."""

    request_id: str
    token_ids: list[int]
    block_table: list[int]
    num_computed: int
    num_prompt_tokens: int


@dataclass
class _Claim:
    """A lookup's answer, kept until the engine allocates (admission may fail and ask again)."""

    num_local: int
    first_chunk: int
    hit_chunks: int
    tail_tokens: int = 0  # of the request's tail (its session's or its prompt's), loaded past the hit chunks
    tail: TailChunk | None = None

    def tokens(self, chunk_tokens: int) -> int:
        end = (self.first_chunk + self.hit_chunks) * chunk_tokens + self.tail_tokens
        return end - self.num_local if self.hit_chunks or self.tail_tokens else 0


@dataclass
class _Tracker:
    keys: list[ChunkKey] = field(default_factory=list)  # of the request's full chunks seen so far
    claim: _Claim | None = None
    loading: RequestLoad | None = None
    next_save: int = 0  # chunks below are saved, loaded from the store, or were held locally
    tail_planned: bool = False  # the prompt's tail is saved, loaded or needs no saving


class SchedulerConnector:
    def __init__(self, store: ChunkStore, namespace: Namespace, block_size: int, config: ConnectorConfig,
                 availability: Availability, stats: StatsRecorder) -> None:
        self.store, self.namespace, self.config = store, namespace, config
        self.availability, self.stats = availability, stats
        self.block_size = block_size
        self.chunk_tokens = namespace.chunk_tokens
        self.blocks_per_chunk = self.chunk_tokens // block_size
        self.pins = PinLedger()
        self.tails = TailRegistry(namespace, block_size)  # paused agent sessions' partial chunks
        self._prompt_tails = config.prompt_tails and config.role == "both"
        self._trackers: dict[str, _Tracker] = {}
        self._planned: list[RequestLoad] = []
        # a producer ranking tokens by the prompt's attention saves its chunks once that is known
        self._after_prompt = config.role == "producer" and config.transfer.ranks_by_attention

    def _keys(self, tracker: _Tracker, token_ids: Sequence[int]) -> list[ChunkKey]:
        """Keys of every full chunk of ``token_ids``, extending the ones already computed."""
        have, full = len(tracker.keys), len(token_ids) // self.chunk_tokens
        if full > have:
            parent = tracker.keys[-1].prefix_hash if have else ROOT_HASH
            tail = token_ids[have * self.chunk_tokens:full * self.chunk_tokens]
            tracker.keys += [ChunkKey(self.namespace, h) for h in prefix_hashes(tail, self.chunk_tokens, parent)]
        return tracker.keys

    def _store_call(self, what: str, fn, default):
        """A store call whose failure turns the connector off for a while instead of failing the step."""
        try:
            return fn()
        except (ValueError, TypeError):
            raise  # keys of another namespace in one call, or similar: a bug of ours
        except Exception as exc:
            self.availability.failed(what, exc)
            return default

    # -- admission ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        """(tokens past the ``num_local`` locally cached ones that the store can supply, whether
        they arrive asynchronously). Chunk-aligned, never past the request's last full chunk.
        The first answer is kept, with the chunks pinned, until ``update_state_after_alloc``."""
        tracker = self._trackers.setdefault(request.request_id, _Tracker())
        claim = tracker.claim
        if claim is None or claim.num_local != num_local:
            self._release(request.request_id, tracker)
            claim = tracker.claim = self._lookup(request, tracker, num_local)
        tokens = claim.tokens(self.chunk_tokens)
        return tokens, tokens > 0 and self.config.load_mode == "async"

    def _lookup(self, request: Request, tracker: _Tracker, num_local: int) -> _Claim:
        first = num_local // self.chunk_tokens
        keys = self._keys(tracker, request.token_ids)[first:]
        if not self.availability.available():
            return _Claim(num_local, first, 0)
        hit = 0
        if keys:  # found and pinned in one store call: nothing is evicted in between
            self.stats.add(lookups=1)
            hit = self._store_call("pin_leading", lambda: self.store.pin_leading(keys, self.config.pin_ttl_s), 0)
        if hit:  # held until the request lets go
            self.pins.hold(request.request_id, keys[:hit])
        claim = _Claim(num_local, first, hit)
        self._claim_tail(request, tracker, claim)
        return claim

    def _claim_tail(self, request: Request, tracker: _Tracker, claim: _Claim) -> None:
        """Past the hit chunks, the request's session tail, when its tokens match and it is
        stored; else, past every full chunk, the longest stored prompt tail its tokens match."""
        end = claim.first_chunk + claim.hit_chunks
        tail = self.tails.match(getattr(request, "session", ""), request.token_ids, tracker.keys, end)
        candidates = [tail] if tail is not None else []
        if not candidates and self._prompt_tails and end == len(tracker.keys):
            candidates = tail_candidates(self.namespace, self.block_size, request.token_ids, tracker.keys)
        for tail in candidates:
            if tail.chunk * self.chunk_tokens + tail.tokens(self.block_size) <= claim.num_local:
                return  # the local prefix cache holds this and every shorter one
            if self._store_call("pin", lambda: self.store.pin([tail.key], self.config.pin_ttl_s), 0):
                self.pins.hold(request.request_id, [tail.key])
                claim.tail, claim.tail_tokens = tail, tail.tokens(self.block_size)
                return
            if not self.availability.available():
                return

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """The engine allocated blocks for every token of ``request``: plan its load."""
        tracker = self._trackers[request.request_id]
        claim, tracker.claim = tracker.claim, None
        local_blocks = claim.num_local // self.block_size
        tracker.next_save = max(tracker.next_save, claim.num_local // self.chunk_tokens)
        if num_external_tokens == 0 or not (claim.hit_chunks or claim.tail):
            self._release(request.request_id, tracker)
            return
        bpc = self.blocks_per_chunk
        loads = []
        for chunk in range(claim.first_chunk, claim.first_chunk + claim.hit_chunks):
            skip = max(0, local_blocks - chunk * bpc)
            blocks = tuple(request.block_table[chunk * bpc + skip:(chunk + 1) * bpc])
            loads.append(ChunkLoad(tracker.keys[chunk], blocks, skip))
        if claim.tail is not None:
            own = request.num_prompt_tokens // self.block_size * self.block_size  # what the prompt's tail would end at
            end = claim.tail.chunk * self.chunk_tokens + claim.tail.tokens(self.block_size)
            tracker.tail_planned = claim.tail.key.namespace == self.namespace and end == own
            chunk = claim.tail.chunk
            skip = max(0, local_blocks - chunk * bpc)
            blocks = tuple(request.block_table[chunk * bpc + skip:chunk * bpc + claim.tail.num_blocks])
            loads.append(ChunkLoad(claim.tail.key, blocks, skip))
        tracker.loading = RequestLoad(request.request_id, claim.first_chunk, loads)
        tracker.next_save = claim.first_chunk + claim.hit_chunks
        self._planned.append(tracker.loading)
        self.stats.add(hit_tokens=num_external_tokens)

    # -- each step ----------------------------------------------------------------------------

    def build_connector_meta(self, items: Sequence[tuple[Request, int]]) -> ConnectorMetadata:
        """The loads planned since the last step, and the full chunks this step's forward
        completes (``num_computed + n`` tokens of each scheduled request)."""
        meta = ConnectorMetadata(loads=self._planned)
        self._planned = []
        if not self.config.saves:
            return meta
        bpc = self.blocks_per_chunk
        for request, n in items:
            tracker = self._trackers[request.request_id]
            done = request.num_computed + n
            full = done // self.chunk_tokens
            saves = []
            if full > tracker.next_save and not (self._after_prompt and done < len(request.token_ids)):
                keys = self._keys(tracker, request.token_ids)
                saves = [ChunkSave(keys[i], keys[i - 1] if i else None, tuple(request.block_table[i * bpc:(i + 1) * bpc]), i)
                         for i in range(tracker.next_save, full)]
                tracker.next_save = full
            if self._prompt_tails and not tracker.tail_planned and done >= request.num_prompt_tokens:
                tracker.tail_planned = True
                saves += self._tail_save(request, tracker)
            if saves:
                meta.saves.append(RequestSave(request.request_id, saves))
        return meta

    def _tail_save(self, request: Request, tracker: _Tracker) -> list[ChunkSave]:
        """The prompt's tail, once its prefill is done: its full blocks past its last full chunk."""
        prompt = request.token_ids[:request.num_prompt_tokens]
        tail = plan_tail(self.namespace, self.block_size, prompt, len(prompt), self._keys(tracker, prompt))
        if tail is None:
            return []
        start = tail.chunk * self.blocks_per_chunk
        parent = tracker.keys[tail.chunk - 1] if tail.chunk else None
        return [ChunkSave(tail.key, parent, tuple(request.block_table[start:start + tail.num_blocks]), tail.chunk)]

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """Loads that finished release their pins; a failed one is saved again once recomputed."""
        for result in output.loads:
            tracker = self._trackers.get(result.request_id)
            if tracker is None or tracker.loading is None:
                continue
            if not result.ok:
                tracker.next_save = min(tracker.next_save, tracker.loading.first_chunk + result.loaded_chunks)
            tracker.loading = None
            self._release(result.request_id, tracker)

    # -- end of a request's residency --------------------------------------------------------

    def request_finished(self, request: Request) -> None:
        """Called before the engine frees the request's blocks (nothing of it is in flight then:
        its loads are settled and its chunks gathered)."""
        tracker = self._trackers.pop(request.request_id, None)
        if tracker is not None:
            self._release(request.request_id, tracker)

    def on_preempt(self, request: Request) -> None:
        """The request loses its blocks; on resume it is looked up again over prompt + output."""
        self.request_finished(request)

    def _release(self, request_id: str, tracker: _Tracker) -> None:
        tracker.claim = None
        for free in by_namespace(self.pins.release(request_id)):  # a session tail is in a namespace of its own
            self._store_call("unpin", lambda: self.store.unpin(free), 0)

    @property
    def num_tracked(self) -> int:
        return len(self._trackers)
