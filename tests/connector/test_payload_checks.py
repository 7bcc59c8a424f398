"""What a reader checks in a slot header beyond key and generation: the KV
layout the writer's worker detected, and the checksum of the payload."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from maru_core.pool.checksum import payload_checksum
from maru_core.pool.commit_records import CommitRecords

from maru_connector.config import parse_config
from maru_connector.resolve import LoadFailure, object_keys, release_pins, resolve_load

from worker_env import BLOCK, CHUNK, WorkerEnv, blocks_equal, load_meta, spec_blocks, step, store_meta, tokens


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


def test_a_flipped_payload_byte_fails_a_verified_load_and_unpins(env):
    writer, _, keys = _store(env)
    fmt = writer._res.engine.fmt
    client = env.index.client()
    loc = env.index.committed[keys[1]]
    env.pool.buffer[loc.offset + 77] ^= 0x10  # one bit of the second chunk's payload
    with pytest.raises(LoadFailure, match="does not match its checksum") as info:
        resolve_load(client, env.pool, fmt, keys, spec_blocks(10, 2), verify_payload=True)
    assert info.value.reason == "header_mismatch"
    assert +env.index.pins == {}
    # The header alone vouches for nothing of the payload: unverified, it resolves.
    release_pins(client, resolve_load(client, env.pool, fmt, keys, spec_blocks(10, 2)))
    env.pool.buffer[loc.offset + 77] ^= 0x10
    release_pins(client, resolve_load(client, env.pool, fmt, keys, spec_blocks(10, 2), verify_payload=True))
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


def test_payload_verification_is_on_by_default_on_the_cpu_backend_only():
    cfg = parse_config({"maru_index_url": "tcp://h:1", "maru_pool_path": "/p"}, BLOCK)
    assert cfg.verify_payload("cpu") and not cfg.verify_payload("cuda")
    forced = parse_config({"maru_index_url": "tcp://h:1", "maru_pool_path": "/p",
                           "maru_verify_payload": True}, BLOCK)
    assert forced.verify_payload("cuda")
    assert CHUNK % BLOCK == 0
