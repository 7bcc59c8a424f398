"""`marucache inspect` and `marucache flush` against a real index process over
loopback: objects stored the way a connector stores them (a head entry naming
the format and the layout fingerprint of the model), listed by model and
format, flushed by model, pinned objects and stores in flight kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from quota_objects import numbered

from maru_core.index.client import IndexClient
from maru_core.index.client_ops import IndexRejected
from maru_core.pool import Pool, SlotHeader
from maru_core.pool.slots import SlotFormat
from maru_core.protocol.messages import MAX_SCAN_ROWS
from maru_tools.index_process import IndexProcess, free_port

MODEL_A = 0x1A2B3C4D5E6F7081  # two models' layout fingerprints (ObjectFormat.fingerprint)
MODEL_B = 0x0F0E0D0C0B0A0908


def store(client: IndexClient, pool: Pool, keys: list[bytes], fmt: SlotFormat, layout: int, length: int) -> None:
    """Reserve, write each head entry as a connector's worker does (its format and layout), commit."""
    slots = list(client.reserve([(k, length) for k in keys]))
    assert None not in slots
    for key, slot in zip(keys, slots):
        pool.write_slot_header(slot.offset, SlotHeader(key, slot.generation, length, fmt=fmt, layout=layout))
    assert client.commit(keys) == [True] * len(keys)


def marucache(*args: str, token_file: str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "maru_core.cli", *args]
    if token_file is not None:
        cmd += ["--token-file", token_file]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, input=stdin,
                           stdin=None if stdin is not None else subprocess.DEVNULL)  # fmt: skip


def json_of(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.fixture
def index():
    metrics_port = free_port()
    args = ("--page-size", "4Ki", "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1")
    with IndexProcess(pool_size="64Mi", extra_args=args) as proc, Pool.attach(proc.pool_path) as pool:
        proc.metrics_port = metrics_port
        client = proc.client()
        try:
            page = pool.geometry.page_size
            store(client, pool, numbered(1, 30), SlotFormat.CHUNKWISE, MODEL_A, page)
            store(client, pool, numbered(2, 5), SlotFormat.LAYERWISE, MODEL_A, 100)
            store(client, pool, numbered(3, 20), SlotFormat.LAYERWISE, MODEL_B, 2 * page)
            yield proc, pool, client
        finally:
            client.close()


def groups_of(report: dict) -> dict[tuple[str, str], tuple[int, int, int, int]]:
    return {(g["model"], g["format"]): (g["objects"], g["pages"], g["bytes"], g["pinned"]) for g in report["groups"]}


def test_inspect_lists_the_objects_by_model_and_format(index):
    proc, pool, _ = index
    page = pool.geometry.page_size
    report = json_of(marucache("inspect", "--index", proc.url, "--json", token_file=proc.token_file))
    assert groups_of(report) == {
        (f"{MODEL_A:016x}", "chunkwise"): (30, 30, 30 * page, 0),
        (f"{MODEL_A:016x}", "layerwise"): (5, 5, 500, 0),
        (f"{MODEL_B:016x}", "layerwise"): (20, 40, 40 * page, 0),
    }
    usage = report["usage"]
    assert usage["objects"] == 55 and usage["pages_committed"] == 75 and usage["pages_used"] == 75
    assert usage["pages_free"] == usage["pages"] - 75 and usage["page_bytes"] == page
    table = marucache("inspect", "--index", proc.url, token_file=proc.token_file)
    assert table.returncode == 0, table.stderr
    assert "MODEL" in table.stdout and f"{MODEL_B:016x}  layerwise  20" in table.stdout
    assert "75 used (75 committed, 0 reserved)" in table.stdout


def test_flush_of_one_model_leaves_the_other_models_objects_retrievable(index):
    proc, _, client = index
    run = marucache("flush", "--index", proc.url, "--model", f"{MODEL_A:016x}", "--yes", "--json",
                    token_file=proc.token_file)  # fmt: skip
    assert json_of(run) | {"requests": 1} == {"index": proc.url, "model": f"{MODEL_A:016x}", "format": None,
                                              "evicted": 35, "evicted_bytes": 35 * 4096, "pinned": 0,
                                              "held_back": 0, "quota": None, "requests": 1}  # fmt: skip
    assert client.retrieve(numbered(3, 20)).misses() == 0, "model B's objects are all still served"
    client.unpin(numbered(3, 20))
    assert client.match_prefix(numbered(1, 30)) == 0 and client.match_prefix(numbered(2, 5)) == 0
    report = json_of(marucache("inspect", "--index", proc.url, "--json", token_file=proc.token_file))
    assert list(groups_of(report)) == [(f"{MODEL_B:016x}", "layerwise")]
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    assert "maru_index_flushed_objects_total 35.0" in scraped
    assert 'maru_index_rpc_duration_seconds_count{op="flush"}' in scraped
    assert 'maru_index_rpc_duration_seconds_count{op="list_objects"}' in scraped


def test_pinned_objects_and_stores_in_flight_survive_a_flush(index):
    proc, pool, client = index
    reader = proc.client()
    try:
        assert reader.retrieve(numbered(3, 4)).misses() == 0  # a load in flight pins these
        in_flight = numbered(4, 3)
        slots = list(client.reserve([(k, 4096) for k in in_flight]))  # a store not committed yet
        report = json_of(marucache("flush", "--index", proc.url, "--yes", "--json", token_file=proc.token_file))
        assert (report["evicted"], report["pinned"]) == (51, 4)
        for key, slot in zip(in_flight, slots):  # the store completes as if nothing happened
            pool.write_slot_header(slot.offset, SlotHeader(key, slot.generation, 4096, layout=MODEL_B))
        assert client.commit(in_flight) == [True] * 3
        assert reader.unpin(numbered(3, 4)) == 4
        assert client.retrieve(numbered(3, 4) + in_flight).misses() == 0
        client.unpin(numbered(3, 4) + in_flight)
        text = marucache("flush", "--index", proc.url, "--format", "layerwise", "--yes", token_file=proc.token_file)
        assert text.returncode == 0 and "flushed 4 objects" in text.stdout and "skipped 0 pinned" in text.stdout
        assert client.match_prefix(in_flight) == 3, "objects of format unspecified were not layerwise"
    finally:
        reader.close()


def test_inspect_after_a_restart_lists_what_the_index_restored(index):
    """The index reads each object's model and format from its committed head in the
    pool, so a restarted index (SIGKILL, then rebuilt from the heads) lists the same."""
    proc, _, client = index
    before = groups_of(json_of(marucache("inspect", "--index", proc.url, "--json", token_file=proc.token_file)))
    proc.kill()
    proc.start()
    after = json_of(marucache("inspect", "--index", proc.url, "--json", token_file=proc.token_file))
    assert groups_of(after) == before and after["usage"]["quarantined"]


def test_a_wrong_token_is_refused_with_a_clear_error(index, tmp_path):
    proc, _, client = index
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token-of-this-cache\n")
    for command in ("inspect", "flush"):
        run = marucache(command, "--index", proc.url, "--yes", token_file=str(wrong)) if command == "flush" else \
            marucache(command, "--index", proc.url, token_file=str(wrong))
        assert run.returncode == 1, run.stderr
        assert f"the index at {proc.url} refused the token in {wrong}" in run.stderr
        assert "Traceback" not in run.stderr
    missing = marucache("inspect", "--index", proc.url, token_file=str(tmp_path / "absent"))
    assert missing.returncode == 2 and "cannot read --token-file" in missing.stderr
    assert client.stats()["keys"] == 55


def test_flush_asks_first_and_without_a_terminal_needs_yes(index):
    proc, _, client = index
    run = marucache("flush", "--index", proc.url, token_file=proc.token_file)
    assert run.returncode == 2 and "pass --yes" in run.stderr
    assert client.stats()["keys"] == 55, "nothing was flushed"
    bad = marucache("flush", "--index", proc.url, "--model", "llama", "--yes", token_file=proc.token_file)
    assert bad.returncode == 2 and "MODEL column of marucache inspect" in bad.stderr


def flush_on_a_terminal(proc: IndexProcess, answer: str, *args: str) -> subprocess.CompletedProcess:
    """``marucache flush`` whose stdin is a terminal (a pty), answering its question with ``answer``."""
    controller, terminal = os.openpty()
    try:
        os.write(controller, answer.encode() + b"\n")
        return subprocess.run([sys.executable, "-m", "maru_core.cli", "flush", "--index", proc.url, "--token-file",
                               proc.token_file, *args], stdin=terminal, capture_output=True, text=True, timeout=60)
    finally:
        os.close(controller), os.close(terminal)


def test_flush_asks_on_a_terminal_what_it_would_remove(index):
    proc, _, client = index
    declined = flush_on_a_terminal(proc, "n", "--model", f"{MODEL_B:016x}")
    assert declined.returncode == 1, declined.stderr
    assert f"Flush 20 objects (160.0 KiB; model {MODEL_B:016x}) from the cache at {proc.url}?" in declined.stdout
    assert client.stats()["keys"] == 55
    accepted = flush_on_a_terminal(proc, "y", "--model", f"{MODEL_B:016x}")
    assert accepted.returncode == 0 and "flushed 20 objects" in accepted.stdout, accepted.stderr
    assert client.stats()["keys"] == 35


def test_a_huge_listing_is_read_a_page_at_a_time():
    """A listing of many objects is never one reply: the index scans at most
    MAX_SCAN_ROWS rows per request (a slice per step), the client follows the cursor."""
    with IndexProcess(pool_size="128Mi", extra_args=("--page-size", "4Ki")) as proc, \
            Pool.attach(proc.pool_path) as pool, proc.client() as client:  # fmt: skip
        keys = numbered(5, 20000)
        for start in range(0, len(keys), 4000):
            store(client, pool, keys[start : start + 4000], SlotFormat.CHUNKWISE, MODEL_A, 64)
        report = json_of(marucache("inspect", "--index", proc.url, "--json", "--page-rows", "3000",
                                   token_file=proc.token_file))  # fmt: skip
        assert report["requests"] == 7 and groups_of(report) == {
            (f"{MODEL_A:016x}", "chunkwise"): (20000, 20000, 20000 * 64, 0)}
        with pytest.raises(IndexRejected, match=f"from 1 to {MAX_SCAN_ROWS}") as refused:
            client._call({"op": "list_objects", "cursor": 0, "limit": MAX_SCAN_ROWS + 1})
        assert refused.value.error_type == "bad_request"
        first = client.list_objects(0, 1000)
        assert first.next_cursor == 1000 and sum(g.objects for g in first.groups) == 1000


def test_a_flush_is_held_to_the_eviction_quota_and_waits_for_its_window():
    """A token holder flushes no faster than its reserves may evict: a window's
    share at a time, waiting for the window (or stopping at --wait, exit 3)."""
    args = ("--page-size", "4Ki", "--max-lease-evict-fraction", "0.01", "--evict-window", "1")
    with IndexProcess(pool_size="16Mi", extra_args=args) as proc, Pool.attach(proc.pool_path) as pool, \
            proc.client() as client:  # fmt: skip
        per_window = int(0.01 * pool.geometry.num_pages)
        keys = numbered(6, 3 * per_window + 5)
        store(client, pool, keys, SlotFormat.CHUNKWISE, MODEL_A, 64)
        assert client.retrieve(keys[-5:]).misses() == 0  # pinned: counted once however often the flush retries
        stopped = marucache("flush", "--index", proc.url, "--yes", "--json", "--wait", "0",
                            token_file=proc.token_file)  # fmt: skip
        assert stopped.returncode == 3, stopped.stderr
        report = json.loads(stopped.stdout)
        assert report["evicted"] == per_window and report["quota"] == "evictions" and report["held_back"] > 0
        finished = json_of(marucache("flush", "--index", proc.url, "--yes", "--json", token_file=proc.token_file))
        assert (finished["evicted"], finished["pinned"], finished["quota"]) == (2 * per_window, 5, None)
        assert finished["requests"] > 2, "it waited for the window at least twice"
        assert client.stats()["keys"] == 5
