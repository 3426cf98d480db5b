"""The bulk channel's byte contract, shared by the daemon (kvstore/daemon/bulk.py) and
the client.

Attach: ``BulkAttach`` (an authenticated RPC) gives a session id and a one-time token; the
client connects to the bulk port and sends ``session (u64 LE) | token (32 bytes)``; the
daemon answers the byte 1, or closes the connection. Then each request is one frame from
the client, answered by frames from the daemon::

    kind (u8) | 3 zero bytes | meta_len (u32 LE) | data_len (u64 LE) | meta | data

    GET    meta GetRequest                   -> CHUNK per chunk, then END; or ERROR
    PUT    meta PutHeader, data the blob     -> DONE or ERROR   (no data when header.slot is set)
    RELEASE                                  -> (no answer) unpin the host-pool chunks of the
                                                last GET (clients send it after END); so do
                                                the next request and closing the connection
    CHUNK  meta GetReply, data the chunk's bytes (none when it went into a slot)
    END    meta CountReply (chunks sent)
    DONE   no meta
    ERROR  meta ErrorReply (gRPC status code and message)

A connection carries one request at a time; after ERROR it stays usable. A request frame is
admitted by the sizes its header announces, before its body is read: one a limit refuses
(the tenant's requests or bytes in flight, the bytes all sessions receive) is answered ERROR
at once, and its body is then read and dropped. A frame that breaks the framing (unknown
kind, oversized meta or data, a RELEASE with meta or data, a body that does not arrive
within ``frame_timeout_s``) closes the connection.
"""

from __future__ import annotations

import struct

FRAME = struct.Struct("<B3xIQ")
HELLO = struct.Struct("<Q32s")
TOKEN_BYTES = 32
MAX_META_BYTES = 4 << 20  # a GetRequest of max_keys_per_request keys is ~100 KiB

GET, PUT, CHUNK, END, DONE, ERROR, RELEASE = 1, 2, 3, 4, 5, 6, 7
REQUEST_KINDS = (GET, PUT, RELEASE)

# The first bytes of the daemon's shared-memory slot arena: a client that maps the arena
# checks them against the nonce its lease names, so it never writes into a stranger's file.
NONCE_BYTES = 16
