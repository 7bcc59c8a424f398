"""PoolIdentity: what an index's hello says it serves, and how a client compares it with its own pool."""

from __future__ import annotations

import os

import pytest

from maru_core.index.client import IndexClient, WrongPool
from maru_core.index.launcher import ThreadedIndex
from maru_core.pool.pool_identity import PoolIdentity

MAPPED = PoolIdentity("u-1", 64 << 20, 2 << 20, "/dev/dax0.0")


def test_the_same_region_under_another_mount_path_matches():
    assert MAPPED.mismatch(PoolIdentity("u-1", 64 << 20, 2 << 20, "/mnt/maru/dax0.0")) is None


@pytest.mark.parametrize("served, differ", [
    (PoolIdentity("u-2", 64 << 20, 2 << 20, "/dev/dax0.0"), "uuid"),
    (PoolIdentity("u-1", 32 << 20, 2 << 20, "/dev/dax0.0"), "size"),
    (PoolIdentity("u-1", 64 << 20, 4 << 20, "/dev/dax0.0"), "offset"),
])
def test_uuid_size_and_offset_each_tell_regions_apart(served, differ):
    assert MAPPED.mismatch(served) == differ


def test_an_older_index_without_the_pool_map_is_checked_on_uuid_and_size_only():
    older = {"lease_id": "l", "lease_ttl_s": 3.0, "geometry": {"uuid": "u-1", "size": 64 << 20, "page_size": 65536}}
    served = PoolIdentity.from_hello(older)
    assert served.offset is None and MAPPED.mismatch(served) is None
    older["geometry"]["uuid"] = "u-2"
    assert MAPPED.mismatch(PoolIdentity.from_hello(older)) == "uuid"


@pytest.mark.parametrize("pool", [{"uuid": 1, "size": 4}, {"uuid": "u", "size": -1}, {"uuid": "u", "size": 4,
                                                                                      "offset": "0"}, []])
def test_a_malformed_pool_map_is_refused(pool):
    with pytest.raises(ValueError):
        PoolIdentity.from_hello({"pool": pool})


def test_hello_names_the_served_region_and_a_client_under_another_path_accepts_it(make_pool, tmp_path):
    pool = make_pool("test-pool-identity", 32 << 20, 64 << 10)
    mount = tmp_path / "mounted-pool"
    os.symlink(pool.where, mount)  # the same file under another path, as another container mounts it
    with ThreadedIndex(pool) as index:
        expected = PoolIdentity.read(str(mount))
        assert expected.path == str(mount) and expected.uuid == pool.geometry.uuid
        with IndexClient(index.url, client_name="t", pool=expected) as client:
            assert client.match_prefix([b"k" * 16]) == 0
        wrong = PoolIdentity("another-pool", pool.geometry.size, 0, pool.where)
        with IndexClient(index.url, client_name="t", pool=wrong) as client:
            with pytest.raises(WrongPool, match="another-pool"):
                client.match_prefix([b"k" * 16])
            assert client.lease_id is None
        # the refused hello ended the lease it opened
        assert index.on_loop(lambda: index.service.server.registry.stats().leases) == 0
