"""`marucache index` on a region of a device (`--pool-offset`), as a real process; a file stands in for the device."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from maru_core.index.client import IndexClient
from maru_core.index.launcher import IndexProcess
from maru_core.pool import Pool, SlotHeader

MiB = 1024 * 1024
REGION = 16 * MiB
DEVICE = 3 * REGION


@pytest.fixture
def device():
    path = f"/dev/shm/maru-test-index-region-{uuid.uuid4().hex}"
    with open(path, "wb") as f:
        f.truncate(DEVICE)
    yield path
    os.unlink(path)


def _index(device: str, *flags: str) -> IndexProcess:
    return IndexProcess(device, pool_size="16Mi", extra_args=["--lease-ttl", "0.5", *flags])


def _marucache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maru_core.cli", *args], capture_output=True, text=True, timeout=30)


def test_an_index_makes_its_pool_in_a_blank_region_and_finds_it_again_after_a_restart(device):
    key, payload = b"k" * 16, os.urandom(4096)
    with _index(device, "--pool-offset", "16Mi") as index:
        assert os.stat(device).st_size == DEVICE
        with Pool.attach(device, offset=REGION) as pool, IndexClient(index.url, heartbeat=False) as client:
            client.heartbeat()
            assert client.geometry == pool.geometry.to_dict() and pool.geometry.size == REGION
            (slot,) = client.reserve([(key, len(payload))])
            pool.view(slot.offset, len(payload))[:] = payload
            pool.write_slot_header(slot.offset, SlotHeader(key=key, generation=slot.generation, length=len(payload)))
            assert client.commit([key]) == [True]
            uuid_before = pool.geometry.uuid
    with open(device, "rb") as f:
        assert f.read(8) == bytes(8)  # the device's first region was never written
    with _index(device, "--pool-offset", str(REGION)) as index:  # a restart: rebuilt from the slot headers
        with Pool.attach(device, offset=REGION) as pool, IndexClient(index.url, heartbeat=False) as client:
            assert pool.geometry.uuid == uuid_before
            (location,) = client.retrieve([key])
            assert bytes(pool.view(location.offset, len(payload))) == payload
            client.unpin([key])


def test_the_first_region_of_a_device_needs_no_offset_flag(device):
    with _index(device) as index, Pool.attach(device) as pool, IndexClient(index.url, heartbeat=False) as client:
        client.heartbeat()
        assert client.geometry["uuid"] == pool.geometry.uuid
        assert (pool.offset, pool.geometry.size) == (0, REGION)  # a region of the larger file, not all of it


@pytest.mark.parametrize(
    ("flags", "status", "words"),
    [
        (["--pool-offset", "3Mi"], 2, "is not a multiple of 2 MiB (2097152 bytes), which DAX devices map in: "
                                      "start the region at 2097152 or 4194304"),
        (["--pool-offset=-2Mi"], 2, "is not a size"),
        (["--pool-offset", "40Mi"], 1, "would end at 58720256, past its end"),
    ],
)
def test_bad_offsets_say_what_to_change_and_leave_the_device_alone(device, flags, status, words):
    done = _marucache("index", "--pool", device, "--pool-size", "16Mi", "--listen", "tcp://127.0.0.1:0", *flags)
    assert done.returncode == status and words in done.stderr, done.stderr
    with open(device, "rb") as f:
        assert not any(f.read())


def test_an_offset_on_a_missing_device_is_refused(device):
    done = _marucache("index", "--pool", device + ".missing", "--pool-size", "16Mi", "--pool-offset", "16Mi",
                      "--listen", "tcp://127.0.0.1:0")  # fmt: skip
    assert done.returncode == 2 and "names a region of an existing DAX device" in done.stderr
    assert not os.path.exists(device + ".missing")


def test_a_pool_moved_to_another_offset_is_refused_naming_both(device):
    with Pool.create(device, REGION, offset=REGION):
        pass
    with open(device, "r+b") as f:  # the pool's first 2 MiB copied one region further
        f.seek(REGION)
        head = f.read(2 * MiB)
        f.seek(2 * REGION)
        f.write(head)
    done = _marucache("index", "--pool", device, "--pool-size", "16Mi", "--pool-offset", "32Mi",
                      "--listen", "tcp://127.0.0.1:0")  # fmt: skip
    assert done.returncode == 1
    assert f"at offset {2 * REGION} says the pool was created at offset {REGION}" in done.stderr
