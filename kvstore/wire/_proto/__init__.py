"""Generated gRPC/protobuf stubs for proto/kvstore.proto (committed; do not edit by hand).

Regenerate after changing the .proto with ``python -m kvstore.wire._proto.regen`` (needs
grpcio-tools); tests/daemon/test_daemon_proto.py fails when the committed stubs are out of date.
"""
