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


def _run_index(device: str, *flags: str) -> tuple[str, str]:
    """Start an index, wait until it listens, stop it; its (pool line, log)."""
    proc = subprocess.Popen([sys.executable, "-m", "maru_core.cli", "index", "--pool", device, *flags,
                             "--listen", "tcp://127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, proc.communicate(timeout=10)
    finally:
        proc.terminate()
        _, log = proc.communicate(timeout=10)
    return line, log


def _copy(device: str, source: int, target: int, length: int) -> None:
    with open(device, "r+b") as f:
        f.seek(source)
        data = f.read(length)
        f.seek(target)
        f.write(data)


def _uuid_at(device: str, offset: int) -> str:
    with Pool.attach(device, offset=offset) as pool:
        return pool.geometry.uuid


@pytest.mark.parametrize("leftover", ["resized", "moved", "data"])
def test_a_region_left_from_an_earlier_allocation_becomes_a_new_pool(device, leftover):
    with Pool.create(device, REGION, offset=0) as neighbour, Pool.create(device, REGION, offset=REGION) as old:
        neighbour_uuid, old_uuid = neighbour.geometry.uuid, old.geometry.uuid
        old.view(old.geometry.data_offset, 4 * MiB)[:] = os.urandom(4 * MiB)
    if leftover == "resized":  # the region shrank in place: a pool of another size at its start
        offset, size, cause = REGION, "8Mi", f"the pool at offset {REGION} is {REGION} bytes but {8 * MiB} were"
    elif leftover == "moved":  # a pool's header and table at another offset than they were made at
        _copy(device, REGION, 2 * REGION, 2 * MiB)
        offset, size, cause = 2 * REGION, "16Mi", f"says the pool was created at offset {REGION}"
    else:  # the region starts inside the data area of the earlier pool
        offset, size, cause = REGION + 2 * MiB, "8Mi", "is not a MaruCache pool"
    line, log = _run_index(device, "--pool-size", size, "--pool-offset", str(offset))
    assert f"at offset {offset} " in line and "0 objects restored" in line
    assert "left from an earlier allocation of the device" in log and cause in log, log
    with Pool.attach(device, offset=offset) as pool:
        assert pool.geometry.uuid not in (neighbour_uuid, old_uuid) and not list(pool.iter_slot_headers())
    assert _uuid_at(device, 0) == neighbour_uuid  # the neighbouring region is untouched


def test_a_pool_file_of_its_own_is_never_overwritten(tmp_path):
    path = f"/dev/shm/maru-test-index-own-{uuid.uuid4().hex}"
    try:
        with Pool.create(path, 2 * REGION) as pool:
            before = pool.geometry.uuid
        done = _marucache("index", "--pool", path, "--pool-size", "16Mi", "--listen", "tcp://127.0.0.1:0")
        assert done.returncode == 1 and f"is {2 * REGION} bytes but {REGION} were expected" in done.stderr
        assert _uuid_at(path, 0) == before
    finally:
        os.unlink(path)
