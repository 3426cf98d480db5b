"""What the two sides of the connector tell each other once per engine step.

The scheduler side (bookkeeping, no tensors) plans a step's loads and saves in
``ConnectorMetadata``; the worker side (tensors, the store's bytes) reports what it did in
``ConnectorOutput``. Units are store chunks; destinations and sources are engine block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.keys import ChunkKey


@dataclass(frozen=True)
class ChunkLoad:
    """One store chunk into a request's blocks. The first chunk of a load may overlap blocks
    the request shares with the local prefix cache: those ``skip_blocks`` are not written."""

    key: ChunkKey
    block_ids: tuple[int, ...]  # destinations: the chunk's blocks past the skipped ones
    skip_blocks: int = 0


@dataclass
class RequestLoad:
    request_id: str
    first_chunk: int  # index in the request's tokens of chunks[0]
    chunks: list[ChunkLoad]


@dataclass(frozen=True)
class ChunkSave:
    """One newly computed full chunk out of a request's blocks."""

    key: ChunkKey
    parent: ChunkKey | None
    block_ids: tuple[int, ...]
    index: int = 0  # the chunk's place in its request (tokens index * chunk_tokens onwards)


@dataclass
class RequestSave:
    request_id: str
    chunks: list[ChunkSave]


@dataclass
class ConnectorMetadata:
    """Scheduler -> worker, once per step: loads to start, and what to save after the forward."""

    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[RequestSave] = field(default_factory=list)


@dataclass
class LoadResult:
    """A request's load, finished: its leading ``loaded_chunks`` are in place; the rest failed
    (missing, corrupt, timed out or the store gone) and their blocks must be recomputed."""

    request_id: str
    loaded_chunks: int
    loaded_tokens: int  # tokens written into the request's blocks (skipped blocks excluded)
    failed_block_ids: tuple[int, ...]
    seconds: float
    bytes: int
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed_block_ids


@dataclass
class ConnectorOutput:
    """Worker -> scheduler, once per step: loads that finished (every sync or layer-wise load of
    the step; asynchronous ones once done) and the seconds each request's saves took."""

    loads: list[LoadResult] = field(default_factory=list)
    save_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def failed_block_ids(self) -> set[int]:
        return {b for r in self.loads for b in r.failed_block_ids}
