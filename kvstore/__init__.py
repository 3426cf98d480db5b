"""The KV-cache store: chunk keys and the blob format, codecs, eviction policies, the Store
(store/), the cluster (cluster/), the daemon (daemon/) with its client (client/) and wire
formats (wire/), the configuration and the command line (cli/)."""

from kvstore.keys import ChunkKey, Namespace, chain_hash, chunk_keys, prefix_hashes

__all__ = ["ChunkKey", "Namespace", "chain_hash", "chunk_keys", "prefix_hashes"]
