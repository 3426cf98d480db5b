"""The Store wing: one process's chunk store over its tiers (docs/store.md).

- ``facade``: ``Store``, the ChunkStore the connector and the daemon use;
- ``index``: the chunk index, the one record of what is where and its only writer;
- ``put_path``: a put, top to bottom (reserve, write first, commit, queue), and promotions;
- ``read_path``, ``fetch``: reads, from whichever tier holds a chunk and is free;
- ``write_behind``, ``ticket``: copies of a put to the slower tiers, after the put returned,
  and a durable put's wait for them;
- ``eviction``: making room in a tier, by its policy;
- ``quota``, ``owner_quota``: what each owner (a daemon's tenant) holds, and keeping it within
  its quotas;
- ``removal``: dropping one tier's copies, deleting a chunk everywhere;
- ``placement``, ``replication``: which tiers and which encoding a chunk gets;
- ``deletes``: removing a chunk's replicas from its tiers;
- ``integrity``, ``recovery``, ``discovery``: checksums, rebuilding the index at start,
  finding chunks a peer wrote on a shared tier;
- ``tier_setup``: building the tiers from the configuration.
"""

from kvstore.store.facade import Store, StoreClosed

__all__ = ["Store", "StoreClosed"]
