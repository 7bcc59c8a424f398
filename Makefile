# Two commands do all the set-up on a fresh machine:
#   make demo   runs the main job on the embedded default
#   make test   runs the static checks, then the whole test suite
VENV ?= .venv
STAMP := $(VENV)/.marucache-installed

.PHONY: setup demo test bench-index clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap.sh scripts/vllm_versions.sh scripts/install_vllm_release.sh
	VENV=$(VENV) bash scripts/bootstrap.sh
	touch $@

demo: $(STAMP)
	$(VENV)/bin/marucache demo

# The static checks (the import contract and mypy: scripts/check_static.sh),
# the connector's scheduler-level tests against the newest vLLM release
# (pinned in scripts/vllm_versions.sh), then the whole suite on the CPU build.
test: $(STAMP)
	VENV=$(VENV) bash scripts/check_static.sh
	VENV=$(VENV) bash scripts/test_vllm_release.sh
	$(VENV)/bin/python -m pytest tests

bench-index: $(STAMP)
	$(VENV)/bin/marucache bench index

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .import_linter_cache

# The operator/index/sidecar image (Dockerfile). CONTAINER_ENGINE=podman works too.
CONTAINER_ENGINE ?= docker
IMAGE ?= ghcr.io/marucache/marucache:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
.PHONY: image
image:
	$(CONTAINER_ENGINE) build -t $(IMAGE) .
