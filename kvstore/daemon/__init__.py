"""The sidecar daemon: one Store served over gRPC, with same-host shared memory (slots and
the host pool) and a bulk TCP channel for Gets and Puts (see docs/daemon.md)."""
