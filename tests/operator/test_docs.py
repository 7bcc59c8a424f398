"""What docs/sidecar.md shows the webhook adding is what the webhook adds."""

from __future__ import annotations

import pathlib
import re

import yaml

from maru_operator.desired import Placement
from maru_operator.injection import CacheInfo, decide
from maru_operator.models import parse_cache

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "sidecar.md"


def test_the_injected_pod_in_the_sidecar_docs_is_the_webhooks_output():
    section = DOC.read_text().split("## In a pod", 1)[1]
    shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    ref, spec = parse_cache({"metadata": {"name": "mycache", "namespace": "inference", "uid": "u"},
                             "spec": {"pool": {"deviceClass": "dax", "size": "64Gi"}}})
    placement = Placement("dax", "cxl-a", "/dev/dax0.0", 0, 64 << 30, ("cxl-1",), "/dev/dax0.0")
    pod = {"metadata": {"name": "p", "namespace": "inference", "labels": {"maru.io/cache": "mycache"}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                    "args": ["--model", "/models/llama"]}]}}
    decision = decide(pod, "mycache", CacheInfo(ref, spec, placement, "Ready"), native=True)
    assert shown == {"spec": decision.patch["spec"]}
