"""A real vLLM CPU engine in its own process, driven over a pipe.

Engine starts are the expensive part of an end-to-end test, so one
`EngineProcess` serves many requests: the parent sends prompts (token ids),
the child runs them through `vllm.LLMEngine` with greedy sampling and answers
with the output token ids and each request's time to first token (TTFT).

The child is a plain `python -m maru_tools.engine_server`
subprocess (not `multiprocessing`), so callers need no `__main__` guard, and
vLLM's own processes (EngineCore, workers) are its children: `close()` ends
the whole tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil


class EngineError(RuntimeError):
    """The engine process failed to start or died; the message ends with its log."""


@dataclass(frozen=True)
class EngineSpec:
    """How to start one engine. `kv_transfer_config=None` runs without a connector."""

    model_dir: str
    kv_transfer_config: dict[str, Any] | None = None
    block_size: int = 32
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 8
    kvcache_space_gib: int = 1
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False
    dtype: str = "float32"  # the model's own dtype (see TinyModelSpec.dtype)
    tensor_parallel_size: int = 1  # > 1 needs multiprocessing (one worker process per rank)
    # False: EngineCore runs inside the engine process (starts in ~4 s);
    # True: vLLM's usual three processes (caller, EngineCore, worker).
    multiprocessing: bool = False
    # vLLM's speculative_config (e.g. n-gram): with one, vLLM collects each
    # step's connector report before it calls wait_for_save.
    speculative_config: dict[str, Any] | None = None
    # vLLM's kv_events_config (e.g. a ZMQ publisher's endpoint): the engine publishes KV events.
    kv_events_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestResult:
    """What one request produced."""

    token_ids: list[int]
    ttft_s: float
    latency_s: float
    num_prompt_tokens: int
    aborted: bool = False
    state_at_abort: str | None = None  # the scheduler's status of an aborted request
    # With generate(dump_kv=True): the prompt's KV as the engine held it right
    # after the prefill, (layers, tokens, kv heads, 2 * head size) raw bytes.
    prompt_kv: bytes | None = None


class EngineProcess:
    """One vLLM engine in a child process. Use as a context manager or `close()`."""

    def __init__(
        self, spec: EngineSpec, log_path: str | os.PathLike, start_timeout_s: float = 300.0, wait: bool = True
    ):
        """Start the engine; with `wait=False` call `wait_ready()` before using it
        (so that several engines can start at once)."""
        self.spec = spec
        self.log_path = Path(log_path)
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env.update(engine_env(spec))
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "maru_tools.engine_server", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # close() signals the whole process group
        )
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self.pid = self._proc.pid
        self._start_timeout_s = start_timeout_s
        self.start_info: dict[str, Any] | None = None
        self._conn.send(("start", dataclasses.asdict(spec)))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "EngineProcess":
        """Block until the engine has started; on failure the process is ended."""
        if self.start_info is None:
            try:
                self.start_info = self._receive(self._start_timeout_s, "start")
            except BaseException:
                self.close()
                raise
        return self

    # -- requests ---------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        *,
        concurrent: bool = False,
        abort_after_s: float | None = None,
        timeout_s: float = 600.0,
        dump_kv: bool = False,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[RequestResult]:
        """Run `prompts` with greedy sampling; results are in prompt order.

        `concurrent=False` runs them one after another (each TTFT is that of
        a request alone); `True` submits them all at once. With
        `abort_after_s`, every request still unfinished that many seconds
        after submission is aborted (its result has `aborted=True`).
        `kv_transfer_params` go to every request (e.g. ``{"maru_load": "sync"}``).
        """
        self._conn.send(("generate", {
            "prompts": [list(map(int, p)) for p in prompts],
            "max_tokens": max_tokens,
            "concurrent": concurrent,
            "abort_after_s": abort_after_s,
            "dump_kv": dump_kv,
            "kv_transfer_params": kv_transfer_params,
        }))
        reply = self._receive(timeout_s, "generate")
        return [RequestResult(**r) for r in reply]

    def private_bytes(self) -> int:
        """Resident anonymous memory of the engine process and all its children (Linux).

        Not RSS: RSS also counts the pool's shared pages each process has
        touched, and those grow as the pool fills, whatever the engine keeps.
        On Linux psutil's ``shared`` is the file and shared-memory part of RSS,
        so RSS minus it is the anonymous part (``RssAnon``)."""
        try:
            proc = psutil.Process(self.pid)
            procs = [proc, *proc.children(recursive=True)]
            infos = [p.memory_info() for p in procs if p.is_running()]
            return sum(info.rss - info.shared for info in infos)
        except psutil.NoSuchProcess as exc:
            raise EngineError(f"engine process {self.pid} is gone") from exc

    def call(self, name: str, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        """Run a named probe in the engine process (see `engine_server.PROBES`)."""
        self._conn.send(("probe", {"name": name, **kwargs}))
        return self._receive(timeout_s, name)

    # -- lifecycle ----------------------------------------------------------------

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine and every process it started; idempotent."""
        if self._proc.poll() is None:
            try:
                self._conn.send(("shutdown", {}))
                self._proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _kill_group(self._proc)
        self._conn.close()
        self._log.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _receive(self, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if self._proc.poll() is not None:
                raise EngineError(
                    f"engine process exited with {self._proc.returncode} during {what}; log:\n"
                    + self.log_tail()
                )
            if time.monotonic() > deadline:
                raise EngineError(f"engine gave no answer to {what} within {timeout_s}s; log:\n" + self.log_tail())
        try:
            status, payload = self._conn.recv()
        except EOFError as exc:
            raise EngineError(f"engine closed its pipe during {what}; log:\n" + self.log_tail()) from exc
        if status != "ok":
            raise EngineError(f"engine failed in {what}: {payload}\nlog:\n" + self.log_tail())
        return payload


def prefix_kv_mismatch(written: bytes | None, read: bytes | None, written_tokens: int, read_tokens: int,
                       prefix_tokens: int, num_layers: int) -> tuple[int, int] | None:
    """Where two prompt-KV dumps (``generate(dump_kv=True)``) first differ
    within the first ``prefix_tokens`` positions, as (layer, position); None
    when those positions hold the same bytes in every layer."""
    if not written or not read:
        return (0, 0)
    row = len(written) // (num_layers * written_tokens)
    if len(read) != row * num_layers * read_tokens:
        return (0, 0)
    for layer in range(num_layers):
        a = written[layer * written_tokens * row:][: prefix_tokens * row]
        b = read[layer * read_tokens * row:][: prefix_tokens * row]
        if a != b:
            return layer, next(i for i in range(len(a)) if a[i] != b[i]) // row
    return None


def engine_env(spec: EngineSpec) -> dict[str, str]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kvcache_space_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if spec.multiprocessing else "0",
        # Several engines share the machine's cores: no pinning.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.update(spec.env)
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """End the engine's process group (vLLM's own children included)."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None and pgid != os.getpgrp():
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def read_json_lines(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (being written) is skipped."""
    records = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return []
    return records

