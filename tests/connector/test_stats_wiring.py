"""Where the connector's counters go: `maru_stats_dir` regions, summed as the sidecar sums them."""

from __future__ import annotations

import os

import pytest
from maru_core.stats import decode, region_files
from maru_core.stats_aggregate import RegionAggregator

from maru_connector.config import MaruConfigError, parse_config
from maru_connector.stats import open_stats

from worker_env import WorkerEnv, load_meta, step, store_meta, tokens

DIRECT = {"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": "/dev/shm/p"}


@pytest.fixture
def env():
    env = WorkerEnv()
    yield env
    env.close()


def test_worker_halves_record_into_the_stats_directory(env, tmp_path):
    writer, _ = env.worker(seed=1, maru_async_store=False, maru_stats_dir=str(tmp_path))
    reader, _ = env.worker(seed=2, maru_stats_dir=str(tmp_path))
    keys = env.keys(tokens(96))
    step(writer, store_meta("w", keys, first_block=0))
    step(reader, load_meta("r", keys, first_block=10))

    files = region_files(tmp_path)
    assert len(files) == 2, "one region per worker half"
    total = RegionAggregator(tmp_path).scan()
    assert total.live == 2
    counters = decode(total.values)["counters"]
    assert counters["store_bytes"] == writer.stats.snapshot()["counters"]["store_bytes"] > 0
    assert counters["load_bytes"] == reader.stats.snapshot()["counters"]["load_bytes"] > 0

    # A finished process's counters stay in the sum (folded), as they do in the sidecar.
    writer.shutdown()
    env.workers.remove(writer)
    after = RegionAggregator(tmp_path).scan()
    assert after.live == 1 and after.folded == 1
    assert decode(after.values)["counters"]["store_bytes"] == counters["store_bytes"]


def test_without_a_directory_counters_stay_in_memory(tmp_path):
    stats = open_stats(parse_config(DIRECT), "scheduler")
    stats.record_lookup(64)
    assert stats.path is None and stats.snapshot()["counters"]["lookup_hit_tokens"] == 64


def test_a_missing_stats_directory_is_a_config_error(tmp_path):
    cfg = parse_config({**DIRECT, "maru_stats_dir": str(tmp_path / "absent")})
    with pytest.raises(MaruConfigError, match="maru_stats_dir=.*not a directory"):
        open_stats(cfg, "scheduler")
    assert not os.listdir(tmp_path)


def test_stats_dir_and_sidecar_socket_conflict():
    with pytest.raises(MaruConfigError, match="maru_stats_dir is for direct attach"):
        parse_config({"maru_index_url": "tcp://127.0.0.1:1", "maru_sidecar_socket": "/s", "maru_stats_dir": "/d"})


def test_the_old_stats_path_knob_points_to_maru_stats_dir():
    with pytest.raises(MaruConfigError, match=r"'maru_stats_path'.*did you mean 'maru_stats_dir'"):
        parse_config({**DIRECT, "maru_stats_path": "/tmp/stats.jsonl"})
