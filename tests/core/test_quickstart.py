"""`marucache quickstart` and `marucache bench index` run end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

QUICK = ["--tokens", "1024", "--chunk-tokens", "256", "--layers", "2", "--object-size", "64Ki", "--pool-size", "32Mi"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_quickstart_stores_reads_back_and_cleans_up():
    done = subprocess.run([sys.executable, "-m", "maru_core.cli", "quickstart", *QUICK],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "stored 8/8 objects" in out and "8/8 hits, 8 verified byte for byte" in out
    pool = re.search(r"pool\s+(\S+)", out).group(1)
    writer, reader = (int(p) for p in re.findall(r"(?:writer|reader)\s+pid (\d+)", out))
    assert writer != reader and not os.path.exists(pool)
    assert _gone(int(re.search(r"\(pid (\d+)\)", out).group(1)))


def test_ctrl_c_cleans_up():
    # A terminal's foreground job gets Ctrl-C with SIGINT at its default; a test suite
    # started in the background (a shell's `&`) inherits it ignored, and an ignored
    # SIGINT never reaches the quickstart. 32,768 objects: seconds of work after the
    # index line, so the signal lands mid-run.
    proc = subprocess.Popen(
        [sys.executable, "-m", "maru_core.cli", "quickstart", "--tokens", "524288", "--layers", "16",
         "--object-size", "16Ki", "--pool-size", "3Gi"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.lstrip().startswith("index"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    rest, err = proc.communicate(timeout=60)
    out = "".join(lines) + rest
    assert proc.returncode == 130, out + err
    assert "cleanup" in out
    assert not os.path.exists(re.search(r"pool\s+(\S+)", out).group(1))
    assert _gone(int(re.search(r"\(pid (\d+)\)", out).group(1)))


def test_bench_index_json_lines():
    done = subprocess.run(
        [sys.executable, "-m", "maru_core.cli", "bench", "index", "--json", "--repeats", "12", "--memory-keys", "2000"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["case"] for r in rows] == [
        "retrieve_layerwise_8000", "retrieve_chunkwise_250", "match_prefix_layerwise_8000",
        "match_prefix_chunkwise_250", "reserve_layerwise_8000", "commit_layerwise_8000", "memory_per_key",
    ]
    for row in rows[:6]:
        assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"] and row["keys_per_s"] > 0
    assert [r["keys"] for r in rows[:6]] == [8000, 250, 8000, 250, 8000, 8000]
    assert rows[0]["target_p50_ms"] == 1.0
    assert 0 < rows[6]["bytes_per_key"] and rows[6]["keys"] == 2000


def test_a_pool_too_small_says_so_instead_of_a_mismatch():
    done = subprocess.run(
        [sys.executable, "-m", "maru_core.cli", "quickstart", "--tokens", "65536", "--layers", "16",
         "--object-size", "16Ki", "--pool-size", "128Mi"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    assert "the pool held only" in done.stdout and "use a larger --pool-size" in done.stdout
    assert not os.path.exists(re.search(r"pool\s+(\S+)", done.stdout).group(1))
