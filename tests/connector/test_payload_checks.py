"""What a reader checks in a slot header beyond key and generation: the KV
layout the writer's worker detected, and the checksum of the payload."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from maru_core.pool import ChecksumKind
from maru_core.pool.checksum import payload_checksum
from maru_core.pool.commit_records import CommitRecords

from maru_connector.metadata import MaruConnectorMetadata
from maru_tools.cluster import wait_until

from maru_connector.config import parse_config
from maru_connector.resolve import LoadFailure, object_keys, release_pins, resolve_load

from worker_env import (
    BLOCK,
    CHUNK,
    LAYERS,
    WorkerEnv,
    blocks_equal,
    finished,
    load_meta,
    report,
    save,
    spec_blocks,
    step,
    store_meta,
    tokens,
    wait_unpinned,
)


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()




def _store(env, n_tokens=64, **knobs):
    writer, kv_w = env.worker(seed=1, maru_async_store=False, **knobs)
    keys = env.keys(tokens(n_tokens))
    step(writer, store_meta("w", keys, first_block=0))
    return writer, kv_w, keys


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_store_records_the_payload_checksum_and_its_layout(env, layerwise):
    writer, _, keys = _store(env, maru_use_layerwise=layerwise)
    fmt = writer._res.engine.fmt
    for key in object_keys(fmt, keys):
        loc = env.index.committed[key]
        header = env.pool.read_slot_header(loc.offset)
        assert header.checksum == payload_checksum(env.pool.view(loc.offset, loc.length))
        assert header.layout == fmt.fingerprint


def test_a_reader_refuses_an_object_written_in_another_kv_layout(env):
    # Same key, same object size, other bytes: float16 KV read as bfloat16 would be garbage.
    _, _, keys = _store(env)
    reader, kv_r = env.worker(seed=2, dtype=torch.float16)
    before = {name: t.clone() for name, t in kv_r.items()}
    errors, meta = step(reader, load_meta("r", keys, first_block=10))
    assert errors == set(range(10, 14)) and meta.failed_load_req_ids == {"r"}
    assert reader.stats.snapshot()["load_failures"]["header_mismatch"] == 1
    assert all(torch.equal(kv_r[n].view(torch.uint8), before[n].view(torch.uint8)) for n in kv_r)  # untouched
    assert +env.index.pins == {}


def test_a_reader_in_the_writer_s_layout_loads_it(env):
    _, kv_w, keys = _store(env)
    reader, kv_r = env.worker(seed=2)
    errors, _ = step(reader, load_meta("r", keys, first_block=10))
    assert errors == set() and blocks_equal(kv_w, range(4), kv_r, range(10, 14))


MODES = ["sync", "overlap", "parked", "parked_overlap"]


def _reader_knobs(mode: str, layerwise: bool) -> dict:
    return {"maru_use_layerwise": layerwise, "maru_overlap_load_with_compute": "overlap" in mode,
            "maru_async_load": mode.startswith("parked"), "maru_park_lone_hits": True}


def _load_in_mode(reader, keys, mode: str, first_block: int = 10):
    """Load ``keys`` into blocks ``first_block`` on as vLLM would in ``mode``; returns the
    load errors and the report of the step whose forward computes the request."""
    if not mode.startswith("parked"):
        return step(reader, load_meta("r", keys, first_block=first_block))
    meta = load_meta("r", keys, first_block=first_block, is_async=True)
    reader.start_load_kv(meta)  # parked: released (or failed) by the loader
    recving: set[str] = set()
    wait_until(lambda: recving.update(finished(reader)[1]) or "r" in recving, 5.0, interval_s=0.01,
               what="the parked load released or failed")
    errors = reader.get_block_ids_with_load_errors()
    if errors:
        return errors, report(reader)
    later = MaruConnectorMetadata(scheduled_req_ids=frozenset({"r"}))
    reader.handle_preemptions(later)
    reader.start_load_kv(later)
    for i in range(LAYERS):
        reader.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
    save(reader, later)
    finished(reader, scheduled={"r"})
    return reader.get_block_ids_with_load_errors(), report(reader)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_payload_byte_fails_the_load_in_every_mode(env, layerwise, mode, where):
    """One bit of one object flipped in the pool after its commit: the reader's
    engine sums the bytes it received, the load fails (vLLM recomputes every
    block of it), it counts as header_mismatch, and no pin stays."""
    writer, kv_w, keys = _store(env, maru_use_layerwise=layerwise)
    fmt = writer._res.engine.fmt
    objects = object_keys(fmt, keys)
    victim = env.index.committed[objects[0] if where == "first" else objects[-1]]
    env.pool.buffer[victim.offset + victim.length - 3] ^= 0x10
    reader, _ = env.worker(seed=2, **_reader_knobs(mode, layerwise))
    errors, meta = _load_in_mode(reader, keys, mode)
    assert errors == set(range(10, 10 + 2 * len(keys))) and meta.failed_load_req_ids == {"r"}
    assert reader.stats.snapshot()["load_failures"]["header_mismatch"] == 1
    wait_unpinned(env)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_an_intact_payload_loads_verified_in_every_mode(env, layerwise, mode):
    _, kv_w, keys = _store(env, maru_use_layerwise=layerwise)
    reader, kv_r = env.worker(seed=2, **_reader_knobs(mode, layerwise))
    errors, meta = _load_in_mode(reader, keys, mode)
    assert errors == set() and not meta.failed_load_req_ids
    assert blocks_equal(kv_w, range(2 * len(keys)), kv_r, range(10, 10 + 2 * len(keys)))
    wait_unpinned(env)


def test_unverified_a_flipped_byte_is_not_looked_for(env):
    """``maru_verify_payload: false``: nothing sums the bytes (the header alone
    vouches for nothing of the payload)."""
    _, _, keys = _store(env)
    loc = env.index.committed[keys[1]]
    env.pool.buffer[loc.offset + 77] ^= 0x10
    reader, _ = env.worker(seed=2, maru_verify_payload=False)
    errors, meta = step(reader, load_meta("r", keys, first_block=10))
    assert errors == set() and not meta.failed_load_req_ids


def test_a_verified_resolve_hands_the_engine_each_header_s_checksum(env):
    writer, _, keys = _store(env)
    fmt = writer._res.engine.fmt
    client = env.index.client()
    pinned = resolve_load(client, env.pool, fmt, keys, spec_blocks(10, 2), verify_payload=True)
    want = [env.pool.read_slot_header(env.index.committed[k].offset).checksum for k in keys]
    assert pinned.check.expected.tolist() == want and pinned.check.verify.all()
    release_pins(client, pinned)
    assert resolve_load(client, env.pool, fmt, keys, spec_blocks(10, 2)).check is None
    release_pins(client, pinned)


def test_an_older_writer_s_xxh3_object_is_checked_in_the_pool_before_any_copy(env):
    pytest.importorskip("xxhash")
    writer, _, keys = _store(env)
    fmt = writer._res.engine.fmt
    loc = env.index.committed[keys[1]]
    old = env.pool.payload_checksum(loc.offset, loc.length, ChecksumKind.XXH3_64)
    header = env.pool.read_slot_header(loc.offset)
    env.pool.write_slot_header(loc.offset, dataclasses.replace(header, checksum=old,
                                                               checksum_kind=ChecksumKind.XXH3_64))
    CommitRecords(env.pool)([loc.offset])  # as the index does on commit
    client = env.index.client()
    pinned = resolve_load(client, env.pool, fmt, keys, spec_blocks(10, 2), verify_payload=True)
    assert pinned.check.verify.tolist() == [True, False]  # the engine checks only the new kind
    release_pins(client, pinned)
    env.pool.buffer[loc.offset + 77] ^= 0x10
    with pytest.raises(LoadFailure, match="does not match its checksum") as info:
        resolve_load(client, env.pool, fmt, keys, spec_blocks(10, 2), verify_payload=True)
    assert info.value.reason == "header_mismatch"
    assert +env.index.pins == {}


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunkwise", "layerwise"])
def test_a_verified_load_refuses_an_object_whose_header_records_no_checksum(env, layerwise):
    """Only a checksum the writer recorded vouches for a payload: an object
    whose header records none (an older writer) fails a verified load,
    whichever of the load's objects it is, and nothing stays pinned."""
    writer, _, keys = _store(env, maru_use_layerwise=layerwise)
    fmt = writer._res.engine.fmt
    last = object_keys(fmt, keys)[-1]
    offset = env.index.committed[last].offset
    header = env.pool.read_slot_header(offset)
    env.pool.write_slot_header(offset, dataclasses.replace(header, checksum=None))
    CommitRecords(env.pool)([offset])  # as an index commits it
    client = env.index.client()
    with pytest.raises(LoadFailure, match=f"payload of key {last.hex()} .* carries no checksum") as info:
        resolve_load(client, env.pool, fmt, keys, spec_blocks(10, 2), verify_payload=True)
    assert info.value.reason == "header_mismatch"
    assert +env.index.pins == {}


def test_payload_verification_is_on_by_default_on_both_backends():
    cfg = parse_config({"maru_index_url": "tcp://h:1", "maru_pool_path": "/p"}, BLOCK)
    assert cfg.verify_payload("cpu") and cfg.verify_payload("cuda")
    off = parse_config({"maru_index_url": "tcp://h:1", "maru_pool_path": "/p",
                        "maru_verify_payload": False}, BLOCK)
    assert not off.verify_payload("cpu") and not off.verify_payload("cuda")
    assert CHUNK % BLOCK == 0


def test_a_layout_of_odd_segments_turns_the_check_off_or_refuses_to_start():
    """Blocks that are not whole 32-bit words cannot be summed: unset, the check is
    off (with a warning); asked for, the worker refuses to start, naming the knob."""
    from types import SimpleNamespace

    from maru_connector.config import MaruConfigError

    odd = SimpleNamespace(layout=SimpleNamespace(kind="cpu", segment_bytes=6, block_bytes_per_layer=6))
    base = {"maru_index_url": "tcp://h:1", "maru_pool_path": "/p"}
    assert not parse_config(base, BLOCK).verify_payload("cpu", odd)
    with pytest.raises(MaruConfigError, match="maru_verify_payload"):
        parse_config({**base, "maru_verify_payload": True}, BLOCK).verify_payload("cuda", odd)
    assert not parse_config({**base, "maru_verify_payload": False}, BLOCK).verify_payload("cpu", odd)
