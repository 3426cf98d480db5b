"""A durable re-put over a peer's blob of the same codec and size on a shared PFS directory.

A puts a chunk durably; B puts it durably too, with other bytes of the same codec and size
(KV computed elsewhere, a mixed codec's own ranking), and its file replaces A's; then A puts
its chunk durably again. A's index still listed its PFS copy as current and synced, and the
copy job checked only that the medium held some value for the key: it wrote nothing and the
put was acknowledged with B's blob on the tier. Once A's host copy was gone A's read was a
miss (the checksum check), and after a restart A's store served B's bytes: a durable put
acknowledged and lost. docs/store.md: a durable put returns only once copies of its own
version are written and synced on every replica tier, and a restart keeps it. The copy job
now compares the medium's header with the blob its replica records and writes when it
differs; the later put replaces the earlier, as a put of a new chunk would.

The header alone does not say that the blob is whole: a payload damaged in place (bit rot, a
torn write of the payload) keeps the header of A's blob: a durable re-put now reads the
payload back before it trusts its copy to a sync."""

from __future__ import annotations

import pytest

from kvstore.blob import HEADER_BYTES
from kvstore.store import Store
from pfs_peers import daemon, two_puts
from shared_tiers import chunks


@pytest.mark.parametrize("host_copy", ["kept", "dropped"])
@pytest.mark.parametrize("kind", ["raw", "mixed"])
def test_a_durable_re_put_over_a_peers_blob_of_the_same_size_writes_its_own(tmp_path, kind, host_copy):
    """``host_copy``: whether A's host RAM still holds the chunk when it puts it again (a
    durable put of what is there, or a new first-tier copy of the same version)."""
    keys, values = chunks(1, seed=21)
    key = keys[0]
    mine, my_codec, theirs, their_codec = two_puts(kind, values[0])
    with Store(daemon(tmp_path, None, "raw")) as a:
        a.put(key, mine, durable=True, codec=my_codec)
        a_blob = a.get_blob(key)
        with Store(daemon(tmp_path, None, "raw")) as b:
            b.put(key, theirs, durable=True, codec=their_codec)  # replaces A's file on the PFS
            b_blob = b.get_blob(key)
        assert b_blob != a_blob and len(b_blob) == len(a_blob), "not another blob of the same size"
        if host_copy == "dropped":
            assert a.drop(keys, "host") == 1
        a.put(key, mine, durable=True, codec=my_codec)  # acknowledged: on every replica tier, synced
        assert a.drop(keys, "host") == 1  # A's index lists its PFS copy alone
        assert a.get_blob(key) == a_blob, "A's acknowledged durable put is not on the PFS"
        a.check_integrity()
    with Store(daemon(tmp_path, None, "raw")) as a:  # a restart keeps what was durable
        assert a.get_blob(key) == a_blob, "after a restart the PFS serves another put's blob"


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("host_copy", ["kept", "dropped"])
def test_a_durable_re_put_over_its_own_blob_with_a_damaged_payload_writes_it_again(tmp_path, host_copy, verify):
    """A's PFS file keeps its header while a payload byte rots. The re-put found the header
    of its own blob, synced the file and was acknowledged; once A's host copy was gone its
    read failed the checksum (a miss), or, where the PFS does not hash payloads on read
    (``verify``), returned the damaged bytes; a restart kept the damaged file."""
    keys, values = chunks(1, seed=22)
    key = keys[0]
    with Store(daemon(tmp_path, None, "raw", verify)) as a:
        a.put(key, values[0], durable=True)
        a_blob = a.get_blob(key)
        (path,) = (tmp_path / "pfs").glob("**/*.kvb")
        with open(path, "r+b") as f:  # one payload byte flipped in place, the header intact
            f.seek(HEADER_BYTES + 100)
            rotten = bytes([f.read(1)[0] ^ 0xFF])
            f.seek(HEADER_BYTES + 100)
            f.write(rotten)
        if host_copy == "dropped":
            assert a.drop(keys, "host") == 1
        a.put(key, values[0], durable=True)  # acknowledged: on every replica tier, synced
        assert a.drop(keys, "host") == 1  # A's index lists its PFS copy alone
        assert a.get_blob(key) == a_blob, "A's acknowledged durable put is not on the PFS whole"
        a.check_integrity()
    with Store(daemon(tmp_path, None, "raw", verify)) as a:  # a restart keeps what was durable
        assert a.get_blob(key) == a_blob, "after a restart the PFS serves a damaged blob"
