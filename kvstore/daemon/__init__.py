"""The sidecar daemon: one Store served over gRPC, with same-host shared-memory slots and a
bulk TCP side channel for payloads (see docs/daemon.md)."""
