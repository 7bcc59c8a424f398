"""The sidecar's HTTP endpoints: `/metrics`, `/healthz` (process alive), `/readyz` (the hand-off works: pool attached, socket served)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

# (ready, reason): the reason is the body of /readyz, so a failing probe says why.
Readiness = Callable[[], tuple[bool, str]]


class EndpointServer:
    """A small threaded HTTP server; `port` is the bound port (useful with port 0)."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, readiness: Readiness):
        handler = _make_handler(registry, readiness)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="maru-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.ident is not None:  # shutdown() waits for serve_forever, which must have started
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def _make_handler(registry: CollectorRegistry, readiness: Readiness) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                try:
                    body = encoder(registry)
                except Exception:  # a scrape must fail visibly, never kill the server
                    log.exception("collecting metrics failed")
                    self._reply(500, b"collecting metrics failed; see the sidecar's log\n")
                    return
                self._reply(200, body, content_type)
            elif path == "/healthz":
                self._reply(200, b"ok\n")
            elif path == "/readyz":
                ready, reason = readiness()
                self._reply(200 if ready else 503, (reason + "\n").encode())
            else:
                self._reply(404, b"not found; try /metrics, /healthz or /readyz\n")

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the http.server API
            log.debug("http: " + format, *args)

    return Handler
