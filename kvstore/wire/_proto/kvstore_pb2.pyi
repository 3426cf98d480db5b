from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Payload(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOB: _ClassVar[Payload]
    TENSOR: _ClassVar[Payload]
BLOB: Payload
TENSOR: Payload

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceSpec(_message.Message):
    __slots__ = ("model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens", "layout", "tp_rank", "tp_size", "tenant")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int
    layout: str
    tp_rank: int
    tp_size: int
    tenant: str
    def __init__(self, model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., layout: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class SlotRef(_message.Message):
    __slots__ = ("lease_id", "index", "generation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    index: int
    generation: int
    def __init__(self, lease_id: _Optional[int] = ..., index: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace", "prefix_hash", "parent_hash", "durable", "blob_bytes", "slot")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceSpec
    prefix_hash: bytes
    parent_hash: bytes
    durable: bool
    blob_bytes: int
    slot: SlotRef
    def __init__(self, namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., prefix_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., durable: _Optional[bool] = ..., blob_bytes: _Optional[int] = ..., slot: _Optional[_Union[SlotRef, _Mapping]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "prefix_hashes", "payload", "slots", "piece_bytes", "pool_views", "pool_lease")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_VIEWS_FIELD_NUMBER: _ClassVar[int]
    POOL_LEASE_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceSpec
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    payload: Payload
    slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    piece_bytes: int
    pool_views: bool
    pool_lease: int
    def __init__(self, namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ..., payload: _Optional[_Union[Payload, str]] = ..., slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ..., piece_bytes: _Optional[int] = ..., pool_views: _Optional[bool] = ..., pool_lease: _Optional[int] = ...) -> None: ...

class GetReply(_message.Message):
    __slots__ = ("index", "chunk_bytes", "data", "last", "pool_runs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    POOL_RUNS_FIELD_NUMBER: _ClassVar[int]
    index: int
    chunk_bytes: int
    data: bytes
    last: bool
    pool_runs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., pool_runs: _Optional[_Iterable[int]] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ("namespace", "prefix_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceSpec
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "prefix_hashes", "wait")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceSpec
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    wait: bool
    def __init__(self, namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ..., wait: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "prefix_hashes", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceSpec
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("namespace", "prefix_hashes", "session", "expected_s", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: NamespaceSpec
    prefix_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    session: str
    expected_s: float
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., prefix_hashes: _Optional[_Iterable[bytes]] = ..., session: _Optional[str] = ..., expected_s: _Optional[float] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("session", "eta_s")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    session: str
    eta_s: float
    def __init__(self, session: _Optional[str] = ..., eta_s: _Optional[float] = ...) -> None: ...

class CountReply(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class ContainsReply(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, present: _Optional[_Iterable[bool]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigReply(_message.Message):
    __slots__ = ("toml",)
    TOML_FIELD_NUMBER: _ClassVar[int]
    toml: str
    def __init__(self, toml: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "chunks", "hits", "misses", "bytes_read", "bytes_written", "evictions", "corruptions", "errors", "read_gbps", "recodes", "lossy_hits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPTIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    READ_GBPS_FIELD_NUMBER: _ClassVar[int]
    RECODES_FIELD_NUMBER: _ClassVar[int]
    LOSSY_HITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    chunks: int
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    evictions: int
    corruptions: int
    errors: int
    read_gbps: float
    recodes: int
    lossy_hits: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., evictions: _Optional[int] = ..., corruptions: _Optional[int] = ..., errors: _Optional[int] = ..., read_gbps: _Optional[float] = ..., recodes: _Optional[int] = ..., lossy_hits: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("tiers", "chunks", "puts", "hits", "misses", "pinned", "write_behind_pending_bytes", "write_behind_queue", "write_behind_dropped", "address", "shm_slots_free", "bulk_sessions", "recode_failures")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_PENDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_QUEUE_FIELD_NUMBER: _ClassVar[int]
    WRITE_BEHIND_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHM_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    BULK_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RECODE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    chunks: int
    puts: int
    hits: int
    misses: int
    pinned: int
    write_behind_pending_bytes: int
    write_behind_queue: int
    write_behind_dropped: int
    address: str
    shm_slots_free: int
    bulk_sessions: int
    recode_failures: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., chunks: _Optional[int] = ..., puts: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., pinned: _Optional[int] = ..., write_behind_pending_bytes: _Optional[int] = ..., write_behind_queue: _Optional[int] = ..., write_behind_dropped: _Optional[int] = ..., address: _Optional[str] = ..., shm_slots_free: _Optional[int] = ..., bulk_sessions: _Optional[int] = ..., recode_failures: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("slots", "request_id")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    slots: int
    request_id: int
    def __init__(self, slots: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class LeaseRef(_message.Message):
    __slots__ = ("lease_id", "request_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    request_id: int
    def __init__(self, lease_id: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("lease_id", "path", "nonce", "slot_bytes", "slots", "offsets", "ttl_s", "pool_path")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    POOL_PATH_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    path: str
    nonce: bytes
    slot_bytes: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    pool_path: str
    def __init__(self, lease_id: _Optional[int] = ..., path: _Optional[str] = ..., nonce: _Optional[bytes] = ..., slot_bytes: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ..., offsets: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ..., pool_path: _Optional[str] = ...) -> None: ...

class BulkAttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BulkAttachReply(_message.Message):
    __slots__ = ("port", "session", "token", "max_frame_bytes", "pin_ttl_s", "max_pinned_bytes")
    PORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    port: int
    session: int
    token: bytes
    max_frame_bytes: int
    pin_ttl_s: float
    max_pinned_bytes: int
    def __init__(self, port: _Optional[int] = ..., session: _Optional[int] = ..., token: _Optional[bytes] = ..., max_frame_bytes: _Optional[int] = ..., pin_ttl_s: _Optional[float] = ..., max_pinned_bytes: _Optional[int] = ...) -> None: ...

class ErrorReply(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
