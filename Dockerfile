# syntax=docker/dockerfile:1
# One image for the operator, the index and the sidecar: `marucache operator|index|sidecar`.
# The vLLM image that carries the connector is built on the upstream vLLM image instead
# (docs/install.md, "The vLLM image"). Build with `make image`.
#
# The base is pinned to an exact Python release; pass a digest for a reproducible build:
#   docker build --build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:... .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# Build stage: the package and its dependencies into a virtual environment. Every dependency
# ships wheels for this platform, so no compiler is needed here either.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY core core
COPY connector connector
COPY sidecar sidecar
COPY operator operator
RUN python -m venv /opt/marucache \
    && /opt/marucache/bin/pip install --only-binary=:all: --no-binary=marucache ".[operator]" \
    && /opt/marucache/bin/marucache --help >/dev/null

# Final stage: the same Python, the environment, a non-root user; no sources, no build tools.
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="marucache" \
      org.opencontainers.image.description="MaruCache operator, index and sidecar" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 65532 marucache \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin marucache
COPY --from=build /opt/marucache /opt/marucache
ENV PATH=/opt/marucache/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# 65532: the user the index and sidecar pods run as (runAsUser/runAsGroup) and the hand-off
# socket's group; the read-only root file system needs nothing written outside /tmp.
USER 65532:65532
ENTRYPOINT ["marucache"]
CMD ["--help"]
