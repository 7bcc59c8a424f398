"""``IndexClient(source_address=...)``: its connections leave from that address,
and a real index process accounts them to that peer (its per-peer quotas key
on the client's address), not to the other clients of this host."""

from __future__ import annotations

import pytest
from quota_objects import numbered, store

from maru_core.index.client import IndexClient
from maru_core.index.client_ops import IndexRejected
from maru_core.pool import Pool
from maru_tools.index_process import IndexProcess

OTHER_PEER = "127.0.0.2"  # loopback too (every 127.x.y.z is, on Linux): another peer than 127.0.0.1


def _pin_until_refused(client: IndexClient, keys: list[bytes]) -> IndexRejected:
    """Retrieve (pin, never unpin) ``keys`` 250 at a time until a quota refuses."""
    for start in range(0, len(keys), 250):
        try:
            client.retrieve(keys[start : start + 250])
        except IndexRejected as exc:
            return exc
    raise AssertionError(f"pinned all {len(keys)} keys without a refusal")


def test_a_client_bound_to_another_address_is_another_peer():
    """127.0.0.1 pins its peer's share of the pool; a client of 127.0.0.1 is then refused
    its pins, one bound to 127.0.0.2 is not, and has a share of its own."""
    peer_share = ("--max-peer-pin-fraction", "0.25")  # below a lease's half: the peer's quota refuses first
    with IndexProcess(pool_size="32Mi", extra_args=("--page-size", "4Ki", *peer_share)) as index, \
            Pool.attach(index.pool_path) as pool:  # fmt: skip
        pages = pool.geometry.num_pages
        hogged, mine = numbered(1, int(0.3 * pages)), numbered(2, 200)
        writer = index.client()
        hog, neighbour = index.client(), index.client()
        bound = IndexClient(index.url, token=index.token, client_name="bound", timeout_s=5,
                            source_address=OTHER_PEER)  # fmt: skip
        try:
            for start in range(0, len(hogged), 1000):
                store(writer, pool, hogged[start : start + 1000])
            store(writer, pool, mine)
            writer.close()

            refused = _pin_until_refused(hog, hogged)  # a quarter of the pool
            assert refused.error_type == "quota" and "peer 127.0.0.1" in refused.message, refused
            with pytest.raises(IndexRejected, match="peer 127.0.0.1"):
                neighbour.retrieve(mine)  # the same peer: its quota is spent

            assert bound.retrieve(mine).misses() == 0  # another peer: pinned
            assert bound.unpin(mine) == len(mine)
            own = _pin_until_refused(bound, hogged)  # and a share of its own, in its own name
            assert own.error_type == "quota" and f"peer {OTHER_PEER}" in own.message, own
        finally:
            for client in (writer, hog, neighbour, bound):
                client.close()


def test_source_address_is_refused_for_a_unix_socket():
    with pytest.raises(ValueError, match="tcp:// URL"):
        IndexClient("unix:///tmp/marucache-index.sock", source_address="127.0.0.2")


def test_source_address_must_be_an_ip_address():
    with pytest.raises(ValueError, match="must be an IP address"):
        IndexClient("tcp://127.0.0.1:9", source_address="localhost:5")


def test_an_address_not_of_this_host_fails_naming_it():
    from maru_core.index.api import IndexUnavailable

    client = IndexClient("tcp://127.0.0.1:9", timeout_s=2, heartbeat=False, source_address="192.0.2.1")
    with pytest.raises(IndexUnavailable, match="from 192.0.2.1"):
        client.connect()
    client.close()
