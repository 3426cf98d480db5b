"""The cluster wing: what a daemon needs to share the pfs and redis tiers with other daemons
(docs/cluster.md).

- ``member``: this daemon as a cluster member (joins, beats, reaps dead members' work);
- ``ledger`` with its scripts in ``lua/``: the budgets, entries and pins every member agrees on;
- ``budgeted_tier``: a shared tier whose capacity is the cluster's budget, kept in the ledger;
- ``lease``: how long this member knows nobody can have taken it for dead (fences its deletes);
- ``shared_index``: which chunks exist in which shared tier, for lookups from any daemon.
"""
