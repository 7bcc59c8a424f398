"""The connector's index clients refuse an index that serves another pool region than the one mapped.

A pod left on a cache's old region (the cache was moved or resized), or
pointed at another cache's index, would otherwise read and write at the
index's offsets in memory that is not the index's pool. Here real index
processes serve regions of one shared file (as the operator carves a DAX
device) and a pool of another file; the worker's clients (built by
``open_resources``) and the scheduler's lookup (``_make_lookup``) talk to
them over TCP.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from kv_builders import make_kv_caches
from maru_connector.config import make_kv_transfer_config, parse_config
from maru_connector.connector import _make_lookup
from maru_tools.index_process import IndexProcess, unique_pool_path
from maru_tools.sidecar_process import SidecarProcess
from maru_connector.worker import open_resources
from maru_core.index.client import WrongPool
from maru_core.pool import Pool, SlotHeader

MiB = 1 << 20
REGION = 16 * MiB
OTHER_OFFSET = 32 * MiB
BLOCK = 16


@pytest.fixture
def device() -> Iterator[str]:
    """A blank file for two pool regions of the same size, at offset 0 and at 32 MiB (the indexes make them)."""
    path = unique_pool_path("maru-wrong-pool-device")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, OTHER_OFFSET + REGION)
    os.close(fd)
    yield path
    os.unlink(path)


@pytest.fixture
def index_at_0(device) -> Iterator[IndexProcess]:
    index = IndexProcess(pool_path=device, pool_size="16Mi").start()
    yield index
    index.stop()


@pytest.fixture
def index_at_32mi(device) -> Iterator[IndexProcess]:
    index = IndexProcess(pool_path=device, pool_size="16Mi", extra_args=("--pool-offset", "32Mi")).start()
    yield index
    index.stop()


@pytest.fixture
def other_pool_index() -> Iterator[IndexProcess]:
    """An index on a pool of another file, of the same size (another UUID)."""
    index = IndexProcess(pool_size="16Mi").start()
    yield index
    index.close()


def worker_clients(index: IndexProcess, pool_path: str):
    cfg = parse_config(make_kv_transfer_config(index.url, pool_path=pool_path, token=index.token,
                                               kv_chunk_tokens=32, load_timeout_s=3.0, lookup_timeout_s=2.0,
                                               prefault_pool=False)["kv_connector_extra_config"], BLOCK)
    kv = make_kv_caches("cpu", layers=2, blocks=8, heads=2, block_size=BLOCK, head_size=8)
    return open_resources(cfg, kv, BLOCK), cfg


def round_trip(client, pool: Pool) -> None:
    key, length = b"k" * 16, 3000
    [slot] = client.reserve([(key, length)])
    pool.view(slot.offset, length)[:] = b"x" * length
    pool.write_slot_header(slot.offset, SlotHeader(key=key, generation=slot.generation, length=length))
    assert client.commit([key]) == [True]
    [location] = client.retrieve([key])
    assert location is not None and location.offset == slot.offset
    client.unpin([key])


def test_worker_and_lookup_use_the_index_of_the_region_they_map(device, index_at_0):
    res, cfg = worker_clients(index_at_0, device)  # maps the region at offset 0
    client = res.client_factory("store")
    try:
        round_trip(client, res.pool)
    finally:
        client.close()
        res.close()
    lookup = _make_lookup(cfg)
    try:
        assert lookup.match("r", [[b"k" * 16]]) == 1
    finally:
        lookup.close()


@pytest.mark.parametrize("served", ["region at another offset of the same file", "pool of the same size, "
                                    "another UUID"])
def test_an_index_serving_another_region_is_refused_by_every_client(device, index_at_0, index_at_32mi,
                                                                     other_pool_index, served, caplog):
    index = index_at_32mi if served.startswith("region") else other_pool_index
    mapped = Pool.attach(device)  # the worker's pool_path: the region at offset 0
    mapped_uuid = mapped.geometry.uuid
    mapped.close()
    with Pool.attach(index.pool_path, offset=OTHER_OFFSET if index is index_at_32mi else 0) as other:
        served_uuid = other.geometry.uuid
    res, cfg = worker_clients(index, device)
    client = res.client_factory("loader")
    try:
        for call in (lambda: client.retrieve([b"k" * 16]), lambda: client.reserve([(b"k" * 16, 100)])):
            with pytest.raises(WrongPool) as refused:
                call()
            message = str(refused.value)
            assert mapped_uuid in message and served_uuid in message, message
            assert "offset 0 of" in message and "re-create this pod" in message
            if index is index_at_32mi:
                assert f"offset {OTHER_OFFSET} of" in message and "uuid, offset differ" in message
            else:
                assert "(uuid differ)" in message
            assert refused.value.error_type == "wrong_pool"
        assert client.lease_id is None  # no lease kept on the wrong index
    finally:
        client.close()
        res.close()
    # The scheduler's lookup (which maps no pool) checks the pool named by its config: a miss, logged.
    lookup = _make_lookup(cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.maru_connector.lookup"):
            assert lookup.match("r", [[b"k" * 16]]) == 0
        assert any("WrongPool" in r.getMessage() and served_uuid in r.getMessage() for r in caplog.records)
    finally:
        lookup.close()


@pytest.mark.parametrize("sidecar_offset, hits", [("32Mi", True), ("0", False)], ids=["same-region", "other-region"])
def test_the_scheduler_checks_the_region_the_sidecar_hands_over(device, index_at_0, index_at_32mi, tmp_path,
                                                                 sidecar_offset, hits, caplog):
    """With a sidecar the scheduler maps no pool: it asks the sidecar which region the workers get."""
    with Pool.attach(device, offset=OTHER_OFFSET) as served, index_at_32mi.client() as writer:
        round_trip(writer, served)  # one object committed in the region the index serves
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir()
    with SidecarProcess(device, sock_dir / "maru.sock", index_at_32mi.url, token_file=index_at_32mi.token_file,
                        pool_offset=sidecar_offset):
        raw = make_kv_transfer_config(index_at_32mi.url, sidecar_socket=str(sock_dir / "maru.sock"),
                                      token=index_at_32mi.token, cache_name="c1", lookup_timeout_s=2.0)
        lookup = _make_lookup(parse_config(raw["kv_connector_extra_config"], BLOCK))
        try:
            with caplog.at_level(logging.WARNING, logger="vllm.maru_connector.lookup"):
                assert lookup.match("r", [[b"k" * 16]]) == (1 if hits else 0)
            refused = [r.getMessage() for r in caplog.records if "WrongPool" in r.getMessage()]
            assert bool(refused) is not hits, refused
            if refused:
                assert "offset 0 of" in refused[0] and f"offset {OTHER_OFFSET} of" in refused[0]
        finally:
            lookup.close()
