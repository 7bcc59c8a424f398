"""A core left out of the forward's OpenMP team, as vLLM reserves one for KV
transfer: the connector's copy threads run there, and hits stay exact.

The engine (async load with overlap) binds its OpenMP team to all cores but
the last, as vLLM's CPU worker does with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``
(on two cores vLLM reserves none by itself). The binding is set through
``OMP_PLACES`` here because the KV oracle reads the engine's blocks in its
own process, which needs multiprocessing off, where vLLM binds nothing; the
benchmark ran vLLM's own binding with multiprocessing on
(``bench/ttft_paired.py --reserve-cpus``). The engine must hold threads
bound to the reserved core alone (the copy threads, ``maru_copy_cpus``
auto) while its engine thread stays on the team's; every hit's KV must be
the writer's, byte for byte, and its tokens recompute's.
"""

from __future__ import annotations

import os

import psutil
import pytest

from maru_tools.workload import random_tokens

from .conftest import (CHUNK_TOKENS, assert_same_prefix_kv, connector_config, index_keys, wait_for_keys,
                       wait_settled)

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6


def thread_cores(pid: int) -> list[frozenset[int]]:
    """The cores each thread of process ``pid`` may run on."""
    return [frozenset(os.sched_getaffinity(t.id)) for t in psutil.Process(pid).threads()]


def test_copies_run_on_the_reserved_core_and_hits_stay_exact(farm, index):
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "needs two cores: one for the forward, one reserved for the copies"
    team, reserved = frozenset(cores[:-1]), frozenset(cores[-1:])  # vLLM reserves the last
    binding = {"OMP_NUM_THREADS": str(len(team)), "OMP_PROC_BIND": "true",
               "OMP_PLACES": "{" + ",".join(map(str, sorted(team))) + "}"}
    writer = farm.get("chunkwise-A", connector_config(index))
    engine = farm.get("reserved-core", connector_config(index, async_load=True, overlap_load_with_compute=True),
                      env=binding)  # fmt: skip

    prompts = [random_tokens((4 + i) * CHUNK_TOKENS + 9, seed=9300 + i) for i in range(3)]
    keys = index_keys(index)
    written = writer.run(prompts, MAX_TOKENS, dump_kv=True)
    wait_for_keys(index, keys + sum(len(p) // CHUNK_TOKENS for p in prompts))

    before = engine.counters()
    served = engine.run(prompts[:1], MAX_TOKENS, dump_kv=True)
    served += engine.run(prompts[1:], MAX_TOKENS, concurrent=True, dump_kv=True)
    after = engine.counters()

    for prompt, wrote, read in zip(prompts, written, served):
        assert_same_prefix_kv(wrote.prompt_kv, read.prompt_kv, len(prompt), len(prompt) // CHUNK_TOKENS * CHUNK_TOKENS)
    reference = farm.get("reference-a", None)
    assert [r.token_ids for r in served[:1]] == reference.outputs(prompts[:1], MAX_TOKENS)
    assert [r.token_ids for r in served[1:]] == reference.outputs(prompts[1:], MAX_TOKENS, concurrent=True)
    hit = after["maru_lookup_hit_tokens_total"] - before["maru_lookup_hit_tokens_total"]
    assert hit == sum(len(p) // CHUNK_TOKENS * CHUNK_TOKENS for p in prompts)

    pid = engine.process.pid
    assert frozenset(os.sched_getaffinity(pid)) == team  # the engine thread, bound by OpenMP
    on_reserved = thread_cores(pid).count(reserved)
    assert on_reserved >= 2, f"{on_reserved} threads of the engine on the reserved core; the load and store threads belong there"
    wait_settled(index)
    farm.close_one(engine.name)
