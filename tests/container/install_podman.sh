#!/usr/bin/env bash
# Make sure buildah, podman and debootstrap are installed, so tests/container/test_image.py can build
# docker/Dockerfile (docker/build_cpu_image.sh) and train inside the image. Called by `make test`.
#
# Idempotent and fast (no apt call) when everything is there. Without root or apt it prints a notice
# and succeeds: the image test then skips (or fails, with VIT_PIPELINE_REQUIRE_IMAGE=1).
set -euo pipefail

needed=(buildah podman debootstrap)
missing=()
for cmd in "${needed[@]}"; do
    # debootstrap lives in /usr/sbin, which a non-login shell may not have on PATH.
    command -v "$cmd" >/dev/null 2>&1 || [[ -x /usr/sbin/$cmd ]] || missing+=("$cmd")
done

if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "install_podman.sh: missing ${missing[*]} and not root; the image test will skip." >&2
    echo "  To run it (as root): apt-get install -y buildah podman debootstrap" >&2
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_podman.sh: missing ${missing[*]} and no apt-get here; install buildah, podman and debootstrap yourself." >&2
    exit 0
fi

echo "install_podman.sh: installing buildah podman debootstrap (missing: ${missing[*]})" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends buildah podman debootstrap; }; then
    echo "install_podman.sh: apt-get could not install buildah podman debootstrap; the image test will skip." >&2
    # CI must not quietly lose the image test.
    [[ ${VIT_PIPELINE_REQUIRE_IMAGE:-0} == 0 ]] || exit 1
fi
