"""The core of the KV-cache store: keys, blobs, codecs, policies, the Store facade."""

from kvstore.keys import ChunkKey, Namespace, chain_hash, chunk_keys, prefix_hashes

__all__ = ["ChunkKey", "Namespace", "chain_hash", "chunk_keys", "prefix_hashes"]
