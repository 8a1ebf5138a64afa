# make demo | demo-mae | demo-mae-16bit | demo-dino | demo-dinov3 | demo-adapt | demo-distill | test | test-fast | lint | bench
# | bench-quality. The first target run creates .venv from constraints.txt;
# later runs reuse it (re-installed only when pyproject.toml or constraints.txt change).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PYTHONUNBUFFERED := 1
# DeepSpeed JIT-builds small C++ ops (shm comm, CPU Adam) into torch's extension cache. One cache per
# checkout: two checkouts sharing ~/.cache/torch_extensions rebuild each other's ops mid-run.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: venv test test-fast lint bench bench-quality demo demo-mae demo-mae-16bit demo-dino demo-dinov3 demo-adapt demo-distill clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,demo,export]'
	$(PY) launch/build_ops.py
	touch $(STAMP)

venv: $(STAMP)

# Everything: unit tests, multi-process DeepSpeed runs, the local Slurm cluster, the MLflow UI in
# Chromium, the Docker image built and trained in (buildah). As root, the system packages those need
# (slurm-wlm, munge, chromium, buildah, podman, debootstrap, dataset-fashion-mnist) are installed with apt when missing;
# otherwise those tests skip and say why.
test: $(STAMP)
	bash tests/cluster/install_slurm.sh
	bash tests/ui/install_chromium.sh
	bash tests/container/install_podman.sh
	bash tests/install_datasets.sh
	$(PY) -m pytest tests

# The fast tier, what to run while editing: unit tests in one process, selected by markers
# (no `slow`: subprocesses or more than a few seconds; no `dist`: multi-process DeepSpeed runs).
test-fast: $(STAMP)
	$(PY) -m pytest tests/unit -q -m "not slow and not dist"

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline launch benchmarks tests
	$(VENV)/bin/hadolint docker/Dockerfile docker/cpu-base.Dockerfile
	$(VENV)/bin/shellcheck -S warning slurm/*.sh launch/*.sh docker/*.sh tests/*.sh tests/cluster/*.sh tests/container/*.sh

# Every benchmark: one row each in results/benchmarks.csv, then docs/benchmarks.md rendered from it.
bench: $(STAMP)
	$(PY) launch/bench.py all

# Every recipe trained on Fashion-MNIST (Debian's dataset-fashion-mnist, installed here when missing and root) and
# judged against raw pixels and a random ViT: about an hour of pretraining per recipe on 2 cores (docs/quality.md).
bench-quality: $(STAMP)
	bash tests/install_datasets.sh
	$(PY) launch/bench.py quality

demo: $(STAMP)
	bash launch/demo.sh

# MAE on the digits without labels, then fine-tuned with 10% of them against the same from scratch.
demo-mae: $(STAMP)
	bash launch/demo_mae.sh

# The same on the digits as single-channel 16-bit arrays (docs/data.md, issue 62).
demo-mae-16bit: $(STAMP)
	bash launch/demo_mae.sh uint16

demo-dino: $(STAMP)
	bash launch/demo_dino.sh

demo-distill: $(STAMP)
	bash launch/demo_distill.sh

# DINOv3's stages (pretraining, Gram anchoring, high resolution), then fine-tuned at 1x and 2x the resolution.
demo-dinov3: $(STAMP)
	bash launch/demo_dinov3.sh

# A DINOv2 source on the digits adapted (--init) on inverted, rotated digits; k-NN against the source, ablations.
demo-adapt: $(STAMP)
	bash launch/demo_adapt.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
