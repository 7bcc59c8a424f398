"""The `marucache` command: one subcommand per process.

Each subcommand lives in the package that owns it and is imported only when
it is run, so `marucache index` never imports vLLM or kopf.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). The module exposes `add_arguments(parser)` and
# `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "index": ("maru_core.index.cli", "run the index service of one pool"),
    "inspect": ("maru_core.index.inspect_cli", "list a cache's objects by model and format, and its usage"),
    "flush": ("maru_core.index.flush_cli", "evict a cache's unpinned objects (all, or one model's)"),
    "bench": ("maru_core.bench_cli", "run a benchmark (index, ...)"),
    "credential": ("maru_core.credential_cli", "print a pod credential minted from the cache token"),
    "sidecar": ("maru_sidecar.cli", "hand the pool to vLLM and export metrics"),
    "operator": ("maru_operator.cli", "run the Kubernetes operator"),
    "demo": ("maru_tools.demo", "two vLLM engines sharing one cache"),
    "quickstart": ("maru_core.quickstart", "store and read back KV objects between two processes (no vLLM)"),
}


def _build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marucache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _build_parser(argv).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
