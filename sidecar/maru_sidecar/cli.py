"""`marucache sidecar`: serve the pool to the vLLM container next to it and export the cache's metrics."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from maru_sidecar.config import ConfigError, SidecarConfig
from maru_sidecar.config import add_arguments as _add_arguments

log = logging.getLogger("maru_sidecar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from maru_core.index.cli import one_line_errors

    one_line_errors(parser)
    _add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM or SIGINT; exit 0 after a clean shutdown, 2 on a bad setting."""
    try:
        config = SidecarConfig.from_args(args)
    except ConfigError as exc:
        print(f"marucache sidecar: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from maru_sidecar.app import Sidecar

    try:
        sidecar = Sidecar(config)
    except OSError as exc:  # e.g. the metrics port is taken
        print(f"marucache sidecar: cannot start: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sidecar.request_stop())
    try:
        sidecar.start()
    except (OSError, ConfigError) as exc:  # e.g. another sidecar serves the socket, the credential is unwritable
        print(f"marucache sidecar: cannot start: {exc}", file=sys.stderr)
        sidecar.stop()
        return 2
    if config.token_file is None:
        log.warning("no --token-file: any process that can reach %s gets the pool", config.socket_path)
    # One parseable line, for people and for scripts that start the sidecar.
    print(
        f"marucache sidecar: cache {config.cache} on {config.socket_path}, "
        f"metrics on http://{config.metrics_host}:{sidecar.endpoints.port}/metrics",
        flush=True,
    )
    while not sidecar.wait(1.0):
        pass
    log.info("shutting down")
    sidecar.stop()
    return 0
