"""The index and sidecar images come from the operator's configuration (`--default-image`, the
chart's image) for every cache that names none: the CRD stores no default in a cache, so an
operator upgrade moves those caches to its new image; a cache that names an image keeps it.
The real kopf operator against kmock."""

from __future__ import annotations

import dataclasses
import pathlib

import yaml
from kube_helpers import Kube, wait_for
from maru_operator.injection import cache_info, sidecar_container
from maru_tools.kube_emulator import OperatorThread

CRD = pathlib.Path(__file__).resolve().parents[2] / "crds" / "marucache.yaml"
POOL = {"pool": {"deviceClass": "dax", "size": "1Gi"}}


def index_image(kube: Kube, cache: str) -> str | None:
    deployment = kube.objects("apps/v1/deployments").get(("default", f"{cache}-maru-index"))
    return deployment["spec"]["template"]["spec"]["containers"][0]["image"] if deployment else None


def test_caches_without_an_image_follow_the_operators_and_move_with_its_upgrade(kube: Kube, options):
    old, new, own = "registry.example.com/maru:1.0", "registry.example.com/maru:1.1", "example.com/pinned:7"
    with OperatorThread(dataclasses.replace(options, default_image=old)):
        kube.apply_cache("follows", POOL)
        kube.apply_cache("pinned", {**POOL, "index": {"image": own}, "sidecar": {"image": own}})
        wait_for(lambda: index_image(kube, "follows") == old, what="the index on the operator's image")
        wait_for(lambda: index_image(kube, "pinned") == own, what="the index on its own image")
        assert "image" not in (kube.cache("follows")["spec"].get("index") or {})
    with OperatorThread(dataclasses.replace(options, default_image=new)):  # the chart upgraded
        wait_for(lambda: index_image(kube, "follows") == new, what="the index moved to the new image")
        assert index_image(kube, "pinned") == own
        follows = kube.cache("follows")
        pinned = kube.cache("pinned")
    # What the webhook injects: the sidecar on the same image as its index.
    for body, image in ((follows, new), (pinned, own)):
        info = cache_info(body, new)
        assert info.placement is not None
        assert sidecar_container(info)["image"] == image


def test_the_crd_stores_no_default_image_in_a_cache():
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for part in ("index", "sidecar"):
        assert "default" not in spec[part]["properties"]["image"], part
