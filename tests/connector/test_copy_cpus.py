"""The CPU backend's copy threads on cores of their own: the OpenMP binding
vLLM's CPU worker sets is read in each of its forms, ``maru_copy_cpus``
resolves to the cores left out of it, bad lists are refused with a message
that says what to write, and a real engine's copy threads (and its pool
prefaulter) run pinned, and the load thread at idle priority when asked,
while their copies stay exact."""

import contextlib
import os
import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_builders import make_kv_caches
from maru_connector.config import MaruConfigError, parse_config
from maru_connector.transfer import TransferEngine, create_engine, prefault
from maru_connector.transfer.copy_cpus import (
    CopyCpusError,
    openmp_cpus,
    parse_cpu_list,
    pin_this_thread,
    process_cpus,
    resolve_copy_cpus,
)
from maru_connector.worker import copy_cpus_for, open_resources
from maru_core.pool import Pool
from test_transfer import ShmPool, round_trip

ALLOWED = {0, 1, 2, 3}


def as_ranges(cpus: set[int]) -> str:
    """The Linux cpu-list form, ranges where cores are consecutive."""
    parts, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


@given(st.sets(st.integers(0, 255), min_size=1))
def test_cpu_lists_parse_back_to_their_cores(cpus):
    assert parse_cpu_list(as_ranges(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "1,,x", "-2"])
def test_malformed_cpu_lists_are_refused(text):
    with pytest.raises(ValueError):
        parse_cpu_list(text)


@pytest.mark.parametrize("environ, team", [
    # what vLLM's OMPProcessManager sets for each OpenMP runtime
    ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),
    ({"GOMP_CPU_AFFINITY": "0 1 2"}, {0, 1, 2}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,2]"}, {0, 2}),
    # other spellings of explicit places
    ({"OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "close"}, {0, 1}),
    ({"OMP_PLACES": "{4:3:2}", "OMP_PROC_BIND": "spread"}, {4, 6, 8}),
    # no binding this module can read: the team may run anywhere
    ({}, None),
    ({"OMP_NUM_THREADS": "1"}, None),
    ({"OMP_PLACES": "{0,1}"}, None),  # places without binding bind nothing
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "false"}, None),
    ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, None),
    ({"GOMP_CPU_AFFINITY": "zero"}, None),
])
def test_the_openmp_team_s_cores_are_read_from_its_binding(environ, team):
    assert openmp_cpus(environ) == team


@pytest.mark.parametrize("setting, environ, expected", [
    ("auto", {"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {3}),
    ("auto", {"GOMP_CPU_AFFINITY": "0-1"}, {2, 3}),
    ("auto", {"OMP_PLACES": "{0,1,2,3}", "OMP_PROC_BIND": "true"}, None),  # no core left
    ("auto", {}, None),  # an unbound team: pinning could not keep them apart
    ("none", {"OMP_PLACES": "{0}", "OMP_PROC_BIND": "true"}, None),
    ("2-3", {}, {2, 3}),
    ("3,9", {}, {3}),  # only cores this process may use
])
def test_the_setting_resolves_to_cores_outside_the_team(setting, environ, expected):
    got = resolve_copy_cpus(setting, environ, ALLOWED)
    assert (set(got) if got else None) == expected


def test_a_list_of_cores_the_process_may_not_use_is_refused():
    with pytest.raises(CopyCpusError, match="names none of the cores.*0,1,2,3"):
        resolve_copy_cpus("8-9", {}, ALLOWED)


def test_a_malformed_knob_stops_start_up_saying_what_to_write():
    raw = {"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": "/dev/shm/unused"}
    assert parse_config(raw).maru_copy_cpus == "auto"
    with pytest.raises(MaruConfigError, match='maru_copy_cpus.*"auto", "none" or cores like'):
        parse_config({**raw, "maru_copy_cpus": "cores 2 and 3"})
    cfg = parse_config({**raw, "maru_copy_cpus": "4096"})  # well formed, checked at start
    with pytest.raises(MaruConfigError, match="names none of the cores"):
        copy_cpus_for(cfg)


def copy_thread_cpus(engine) -> dict[str, set[int]]:
    return {t.name: os.sched_getaffinity(t.native_id) for t in engine._threads}


def settled(read, expected, timeout_s: float = 10.0):
    """``read()`` once it returns ``expected`` (a copy thread sets its cores
    and priority first thing, but a moment after the engine is built), or
    its last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


@contextlib.contextmanager
def round_tripped(seed: int, **options):
    """The CPU engines a store-and-load round trip built with ``options`` for
    ``create_engine`` (its bytes compared), still open; closed after."""
    pool = ShmPool(1 << 20)
    made = []

    def engine_with_options(*args, **kwargs):
        made.append(create_engine(*args, **options, **kwargs))
        return made[-1]

    try:
        round_trip(engine_with_options, pool, "cpu", layerwise=False, chunks=3,
                   rng=random.Random(seed), adjacent=False)
        yield made
    finally:
        for engine in made:
            engine.close()
        pool.close()


def test_copy_threads_run_pinned_and_their_copies_stay_exact():
    mine = os.sched_getaffinity(0)
    cpus = frozenset({max(mine)})
    with round_tripped(7, copy_cpus=cpus) as made:
        for engine in made:
            assert engine.prefaulter.wait(timeout=30)
        for engine in made:
            assert copy_thread_cpus(engine) == {"maru-load": set(cpus), "maru-store": set(cpus)}
        assert os.sched_getaffinity(0) == mine  # the caller's thread is left alone


def test_the_prefaulter_runs_on_the_copy_cores(monkeypatch):
    cpus = frozenset({max(os.sched_getaffinity(0))})
    seen = []
    real = prefault.populate

    def record(address, nbytes):
        seen.append(os.sched_getaffinity(0))
        real(address, nbytes)

    monkeypatch.setattr(prefault, "populate", record)
    pool = ShmPool(8 << 20)
    try:
        kv = make_kv_caches("cpu", layers=2, blocks=8)
        engine = create_engine(pool.buffer, kv, TransferEngine.detect(kv, 32, False),
                                       copy_cpus=cpus)
        try:
            assert engine.prefaulter.wait(timeout=30)
        finally:
            engine.close()
        assert seen and all(s == set(cpus) for s in seen)
    finally:
        pool.close()


def test_the_worker_pins_copies_off_the_cores_vllm_binds_its_forward_to(monkeypatch):
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.fail("this test needs two cores: one for the forward, one for the copies")
    team = min(allowed)
    monkeypatch.setenv("OMP_PLACES", f"{{{team}}}")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    # As OpenMP leaves it: the engine thread, which builds the engine, bound
    # to the team's core (its own affinity no longer shows the free one).
    os.sched_setaffinity(0, {team})
    path = f"/dev/shm/maru-copy-cpus-worker-{os.getpid()}"
    pool = Pool.create(path, 4 << 20, page_size=os.sysconf("SC_PAGE_SIZE"))
    try:
        cfg = parse_config({"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": path,
                            "maru_kv_chunk_tokens": 32}, 16)
        kv = make_kv_caches("cpu", layers=2, blocks=8, heads=2, block_size=16, head_size=8)
        res = open_resources(cfg, kv, 16)
        try:
            assert res.engine.copy_cpus == frozenset(allowed - {team})
            assert settled(lambda: copy_thread_cpus(res.engine)["maru-load"], allowed - {team}) \
                == allowed - {team}
        finally:
            res.close()
    finally:
        os.sched_setaffinity(0, allowed)
        pool.close()
        os.unlink(path)


def test_a_pin_the_kernel_refuses_leaves_the_thread_where_it_was(caplog):
    before = os.sched_getaffinity(0)
    pin_this_thread(frozenset({4095}))  # no such core
    assert os.sched_getaffinity(0) == before
    assert "copy thread not pinned to cores 4095" in caplog.text


def test_the_process_cores_are_not_the_bound_thread_s():
    allowed, mine = process_cpus(), os.sched_getaffinity(0)
    assert allowed >= mine
    try:
        os.sched_setaffinity(0, {min(mine)})
        assert process_cpus() == allowed
    finally:
        os.sched_setaffinity(0, mine)


@pytest.mark.parametrize("priority, policy", [("normal", os.SCHED_OTHER), ("idle", os.SCHED_IDLE)])
def test_the_load_thread_runs_at_the_priority_asked_for_and_copies_stay_exact(priority, policy):
    with round_tripped(8, copy_priority=priority) as made:
        for engine in made:
            # Stores stay at normal priority: nothing waits for them.
            assert {t.name: os.sched_getscheduler(t.native_id) for t in engine._threads} == {
                "maru-load": policy, "maru-store": os.SCHED_OTHER}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is left alone


@pytest.mark.parametrize("knob, policy", [({}, os.SCHED_IDLE),
                                          ({"maru_copy_priority": "normal"}, os.SCHED_OTHER)])
def test_the_worker_runs_copies_at_the_configured_priority(knob, policy):
    raw = {"maru_index_url": "tcp://127.0.0.1:1", "maru_kv_chunk_tokens": 32}
    path = f"/dev/shm/maru-copy-priority-worker-{os.getpid()}"
    pool = Pool.create(path, 4 << 20, page_size=os.sysconf("SC_PAGE_SIZE"))
    try:
        cfg = parse_config({**raw, "maru_pool_path": path, **knob}, 16)
        kv = make_kv_caches("cpu", layers=2, blocks=8, heads=2, block_size=16, head_size=8)
        res = open_resources(cfg, kv, 16)
        try:
            load_thread = res.engine._threads[0].native_id
            assert settled(lambda: os.sched_getscheduler(load_thread), policy) == policy
        finally:
            res.close()
    finally:
        pool.close()
        os.unlink(path)


def test_a_copy_priority_other_than_idle_or_normal_stops_start_up():
    raw = {"maru_index_url": "tcp://127.0.0.1:1", "maru_pool_path": "/dev/shm/unused"}
    assert parse_config(raw).maru_copy_priority == "idle"
    with pytest.raises(MaruConfigError, match="maru_copy_priority must be one of normal, idle, got 'low'"):
        parse_config({**raw, "maru_copy_priority": "low"})
