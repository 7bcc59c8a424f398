"""`marucache credential`: print a pod credential minted from a cache token file.

For engines that present the cache token themselves (several engines on one
machine in the embedded default): a credential each makes each its own peer
at the index (its own quotas and share of the pool) instead of one peer per
address. In Kubernetes each pod's sidecar writes its own (`--credential-file`).
"""

from __future__ import annotations

import argparse
import sys

from maru_core.pod_credentials import check_pod, mint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", required=True, help="file holding the cache token (the index's --token-file)")
    parser.add_argument("--pod", required=True, metavar="NAMESPACE/NAME", help="the identity the credential names")


def run(args: argparse.Namespace) -> int:
    from maru_core.index.cli import read_token  # the index's own checks: a file it would refuse is refused here

    try:
        check_pod(args.pod)
    except ValueError as exc:
        print(f"marucache credential: --pod: {exc}", file=sys.stderr)
        return 2
    try:
        token = read_token(args.token_file)
    except ValueError as exc:
        print(f"marucache credential: {exc}", file=sys.stderr)
        return 2
    print(mint(token, args.pod))
    return 0
