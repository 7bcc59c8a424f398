"""What a vLLM user sees of the connector in vLLM's log.

vLLM configures its own logger tree (handler, format, level) and nothing
else; the connector's records must come out through it, formatted like
vLLM's own: a line saying what the connector does at start-up, one DEBUG line
per hit, and a burst of one warning collapsed to a few lines with counts.
Real parts: vLLM's own logging set-up in a fresh interpreter, vLLM's own
``Scheduler`` with both connector halves (``SteppedEngine``) on a real index
process, and index clients failing against a real closed port.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from maru_connector.config import make_kv_transfer_config
from maru_connector.log import ROOT_NAME, repeats
from maru_connector.lookup import LookupService
from maru_core.index.client import IndexClient
from maru_core.pool import Pool
from maru_tools.index_process import IndexProcess
from maru_tools.stepper import SteppedEngine
from maru_tools.tiny_model import TinyModelSpec, build_tiny_model
from maru_tools.workload import random_tokens

CHUNK = 32
BLOCK = 16
# vLLM's line: "(PROCESS pid=N) LEVEL MM-DD HH:MM:SS [FILE:LINE] message" (vllm/logger.py's _FORMAT).
VLLM_LINE = re.compile(r"^\((?P<process>[^ ]+) pid=\d+\) (?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d "
                       r"\[(?P<file>[^\]:]+):\d+\] (?P<message>.*)$")


class _Records(logging.Handler):
    """Every record that reaches the connector's loggers, whatever vLLM did to the handlers above them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, containing: str = "") -> list[str]:
        return [r.getMessage() for r in self.records if containing in r.getMessage()]


@pytest.fixture
def connector_log() -> Iterator[_Records]:
    """The connector's records at DEBUG (as with VLLM_LOGGING_LEVEL=DEBUG)."""
    logger = logging.getLogger(ROOT_NAME)
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_tiny_model(TinyModelSpec(num_layers=2, seed=0)))


@pytest.fixture(scope="module")
def index() -> Iterator[IndexProcess]:
    proc = IndexProcess(pool_size="64Mi")
    proc.start()
    yield proc
    proc.close()


def test_connector_records_come_out_in_vllm_s_format():
    """Configured as vLLM's engine process configures it, a connector warning
    (a request's bogus ``maru_load``) and an INFO line come out as vLLM's lines do."""
    script = (
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging, init_logger\n"
        "configure_logging(LoggingConfig())\n"  # what EngineCore.run_engine_core does first
        "init_logger('vllm.probe').info('a line of vLLM itself')\n"
        "from maru_connector.request_params import requested_load_mode\n"
        "assert requested_load_mode({'maru_load': 'bogus'}, async_load=False, overlap=False) is None\n"
        "from maru_connector.config import parse_config\n"
        "from maru_connector.worker import copy_cpus_for\n"
        "copy_cpus_for(parse_config({'maru_index_url': 'tcp://127.0.0.1:1', 'maru_pool_path': '/p',\n"
        "                            'maru_copy_cpus': '0'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_LOGGING_COLOR": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    vllm_own = next(VLLM_LINE.match(line) for line in lines if "a line of vLLM itself" in line)
    assert vllm_own is not None, lines
    warning = [line for line in lines if "bogus" in line]
    info = [line for line in lines if "copy threads on cores [0]" in line]
    assert len(warning) == 1 and len(info) == 1, lines[-20:]
    for line, level, file in ((warning[0], "WARNING", "request_params.py"), (info[0], "INFO", "worker.py")):
        match = VLLM_LINE.match(line)
        assert match is not None, f"not in vLLM's format: {line!r}"
        assert (match["level"], match["file"]) == (level, file)
        assert match["process"] == vllm_own["process"]
    assert "unknown maru_load='bogus'" in warning[0] and "use one of 'sync', 'overlap', 'park'" in warning[0]


def test_each_role_says_once_at_start_what_it_does_and_each_hit_has_a_debug_line(model_dir, index,
                                                                                  connector_log):
    with Pool.attach(index.pool_path) as pool:
        uuid, size = pool.geometry.uuid, pool.geometry.size
    config = make_kv_transfer_config(index.url, pool_path=index.pool_path, token=index.token,
                                     kv_chunk_tokens=CHUNK, lookup_timeout_s=2.0, load_timeout_s=5.0,
                                     cache_name="team-a", prefault_pool=False)
    prompt = random_tokens(3 * CHUNK + 5, seed=4242)
    writer = SteppedEngine(model_dir, config, block_size=BLOCK)
    try:
        keys = int(index.stats()["keys"])
        writer.add("w", prompt)
        writer.run(until=lambda: "w" in writer.finished)
        _wait(lambda: int(index.stats()["keys"]) >= keys + 3, "the writer's three chunks committed")
    finally:
        writer.close()
    for role in ("scheduler", "worker"):
        [line] = connector_log.messages(f"MaruCache connector ({role})")
        assert f"cache 'team-a', pool file {index.pool_path} (pool {uuid}, {size / (1 << 30):.2f} GiB" in line
        for words in (f"index {index.url}", f"format chunkwise in {CHUNK}-token chunks",
                      "hits load in the step that computes it", "overlap with compute off",
                      "payload verification on (default)", "stores async"):
            assert words in line, (words, line)

    reader = SteppedEngine(model_dir, config, block_size=BLOCK)
    try:
        reader.add("r", prompt)
        reader.run(until=lambda: "r" in reader.finished)
    finally:
        reader.close()
    [hit] = connector_log.messages("hit r:")
    match = re.fullmatch(r"hit r: (\d+) tokens, (\d+) bytes loaded \(sync\)", hit)
    assert match is not None, hit
    assert int(match[1]) == 3 * CHUNK and int(match[2]) > 0
    assert [r.levelname for r in connector_log.records if r.getMessage() == hit] == ["DEBUG"]


def test_an_index_outage_logs_a_few_lines_with_counts_not_one_per_lookup(monkeypatch, connector_log):
    """55 failed lookups over 25 s (the index down, a lookup every 0.45 s) give
    the first warning, then one line per interval with the count held back."""
    with socket.socket() as probe:  # a port nothing listens on: every connection is refused
        probe.bind(("127.0.0.1", 0))
        dead_url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    now = [1000.0]
    monkeypatch.setattr(repeats, "_clock", lambda: now[0])
    lookup = LookupService(lambda: IndexClient(dead_url, client_name="outage", timeout_s=1.0), timeout_s=2.0,
                           retry_after_s=0.1, clock=lambda: now[0])
    try:
        for i in range(55):
            assert lookup.match(f"r{i}", [[b"k" * 16]]) == 0
            now[0] += 0.45
    finally:
        lookup.close()
    repeats.flush()
    lines = connector_log.messages("index lookup failed")  # the flushed count quotes the template
    assert 2 <= len(lines) <= 5, lines
    shown = [line for line in lines if line.startswith("MaruCache index lookup failed")]
    held = sum(int(m) for line in shown for m in re.findall(r"\[(\d+) more like this in the last", line))
    flushed = sum(int(m) for line in lines for m in re.findall(r"^(\d+) more warnings like", line))
    assert len(shown) + held + flushed == 55, lines
    assert "Connection refused" in shown[0], shown[0]


def _wait(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
