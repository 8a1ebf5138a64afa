#!/usr/bin/env bash
# Make sure buildah, podman and debootstrap are installed, so tests/container/test_image.py can build
# docker/Dockerfile (docker/build_cpu_image.sh) and train inside the image. Called by `make test`; see
# tests/apt_install.sh (skips without root, fails with VIT_PIPELINE_REQUIRE_IMAGE=1 if apt fails).
set -euo pipefail
exec bash "$(dirname "$0")/../apt_install.sh" install_podman.sh VIT_PIPELINE_REQUIRE_IMAGE "the image test" \
    "buildah podman debootstrap" buildah podman debootstrap
