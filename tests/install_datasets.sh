#!/usr/bin/env bash
# Make sure Debian's dataset-fashion-mnist is installed (the IDX files in /usr/share/datasets/fashion-mnist),
# so the Fashion-MNIST tests (make_shards --source fashion-mnist, bench.py quality --smoke) read the real set.
# Called by `make test` before pytest; see tests/apt_install.sh (skips without root, fails with
# VIT_PIPELINE_REQUIRE_DATASETS=1 if apt fails).
set -euo pipefail
exec bash "$(dirname "$0")/apt_install.sh" install_datasets.sh VIT_PIPELINE_REQUIRE_DATASETS \
    "the Fashion-MNIST tests" /usr/share/datasets/fashion-mnist dataset-fashion-mnist
