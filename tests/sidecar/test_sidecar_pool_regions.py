"""Two caches on two regions of one device, as the operator carves a DAX device: an index and a sidecar
each (real processes), and connector-like clients that map their pool through the hand-off."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from sidecar_helpers import HoldingClient, SidecarProcess, run_client

from maru_core.handoff import HandoffUnavailable, fetch_pool
from maru_core.index.client import IndexClient
from maru_core.index.launcher import IndexProcess
from maru_core.pool import Pool, SlotHeader
from maru_core.pool.geometry import HEADER_REGION

MiB = 1024 * 1024
REGION = 16 * MiB
DEVICE = 3 * REGION  # the third region stays unallocated


@dataclass
class Cache:
    name: str
    offset: int
    token: str
    sock: Path
    index: IndexProcess
    sidecar: SidecarProcess


@pytest.fixture
def device():
    """A blank file standing in for one DAX device (a new device reads as zeros)."""
    path = f"/dev/shm/maru-test-device-{uuid.uuid4().hex}"
    with open(path, "wb") as f:
        f.truncate(DEVICE)
    yield path
    os.unlink(path)


@pytest.fixture
def workdir():
    directory = Path(tempfile.mkdtemp(prefix="maru-rg-", dir="/tmp"))  # short: socket paths must fit
    yield directory
    shutil.rmtree(directory)


@pytest.fixture
def start_cache(device, workdir):
    """Starts the index and the sidecar of a cache on the region at `offset`, with the flags the
    operator emits (`--pool-offset` only past the device's start); all are stopped at the end."""
    started: list[Cache] = []

    def start(name: str, offset: int) -> Cache:
        token, token_file = f"token-of-{name}-0123456789", workdir / f"{name}.token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        (workdir / name).mkdir()
        offset_flag = ["--pool-offset", str(offset)] if offset else []
        index = IndexProcess(device, pool_size=str(REGION), token_file=str(token_file),
                             extra_args=offset_flag)  # fmt: skip
        index.start()
        sidecar = SidecarProcess(device, workdir / name / "maru.sock", index.url, token_file=str(token_file),
                                 cache=name, pool_offset=str(offset) if offset else None)  # fmt: skip
        cache = Cache(name, offset, token, sidecar.socket_path, index, sidecar)
        started.append(cache)
        sidecar.start()
        return cache

    yield start
    for cache in started:
        cache.sidecar.close()
        cache.index.stop()


def _read(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _store(cache: Cache, device: str, client: HoldingClient, key: bytes, payload: bytes) -> int:
    """Store `payload` under `key` in `cache` the connector's way: reserve, data through the handed-off
    mapping, slot header, commit. Returns the slot's offset in the pool."""
    with IndexClient(cache.index.url, token=cache.token, heartbeat=False) as index:
        (slot,) = index.reserve([(key, len(payload))])
        assert client.ask(f"write {slot.offset} {payload.hex()}") == "ok"
        with Pool.attach(device, offset=cache.offset) as pool:
            pool.write_slot_header(slot.offset, SlotHeader(key=key, generation=slot.generation, length=len(payload)))
        assert index.commit([key]) == [True]
    return slot.offset


def test_two_caches_on_two_regions_of_one_device_never_see_each_others_bytes(start_cache, device):
    a, b = start_cache("a", 0), start_cache("b", REGION)
    clients = {}
    try:
        for cache in (a, b):
            assert "pool attached" in cache.sidecar.wait_ready()
            clients[cache.name] = client = HoldingClient(cache.sock, cache.name, cache.token)
            info = client.info
            assert info["ok"], info
            # Each client reads its own pool's header through its own mapping of the handed descriptor.
            assert info["magic"] == "MARUPOOL" and client.ask("magic") == "MARUPOOL"
            assert info["offset"] == info["handed_offset"] == cache.offset
            assert info["mapped_bytes"] == info["size"] == REGION
            with IndexClient(cache.index.url, token=cache.token, heartbeat=False) as index:
                index.heartbeat()
                assert index.geometry["uuid"] == info["uuid"]  # the index serves that same pool
        assert clients["a"].info["uuid"] != clients["b"].info["uuid"]

        key = b"same-prefix-key!"  # the same key in both caches, different bytes behind it
        payload = {"a": os.urandom(4096), "b": os.urandom(4096)}
        slot = {c.name: _store(c, device, clients[c.name], key, payload[c.name]) for c in (a, b)}
        assert slot["a"] == slot["b"]  # the same place in each pool: only the region tells them apart
        for cache in (a, b):
            assert clients[cache.name].ask(f"read {slot[cache.name]} 4096") == payload[cache.name].hex()
            assert _read(device, cache.offset + slot[cache.name], 4096) == payload[cache.name]

        only_a = b"only-in-cache-a!"
        _store(a, device, clients["a"], only_a, os.urandom(4096))
        with IndexClient(b.index.url, token=b.token, heartbeat=False) as index_b:
            assert index_b.match_prefix([only_a]) == 0
            assert index_b.stats()["keys"] == 1
        assert _read(device, 2 * REGION, HEADER_REGION) == bytes(HEADER_REGION)  # the free region untouched
    finally:
        for client in clients.values():
            client.close()


def test_a_sidecar_pointed_at_a_region_without_a_pool_hands_nothing_out(start_cache, device, workdir):
    a = start_cache("a", 0)
    stray = SidecarProcess(device, workdir / "stray.sock", a.index.url, cache="a", pool_offset=str(2 * REGION))
    try:
        stray.start()
        with pytest.raises(HandoffUnavailable, match="all zeros"):
            fetch_pool(str(stray.socket_path), None, "a", timeout_s=1.0)
        code, body = stray.get("/readyz")
        assert code == 503 and "pool not attached" in body
        assert run_client(a.sock, "a", a.token)["offset"] == 0  # the real one still serves
    finally:
        stray.close()
