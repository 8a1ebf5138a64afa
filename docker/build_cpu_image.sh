#!/usr/bin/env bash
# Build docker/Dockerfile on a CPU base, with no Docker engine and no registry: `bash docker/build_cpu_image.sh`.
#
#   1. Debian:  debootstrap bookworm (+ Python, venv, g++, headers) -> `podman import` -> $DEBIAN_IMAGE
#   2. base:    docker/cpu-base.Dockerfile: torch/torchvision as constraints.txt pins them  -> $BASE_IMAGE
#   3. image:   docker/Dockerfile, unchanged, with BASE_IMAGE=$BASE_IMAGE                   -> $IMAGE
#
# Each part prints how long it took. Parts 2 and 3 use buildah's layer cache: a second run rebuilds
# only what changed (new code: the COPY layers, seconds; constraints.txt or pyproject.toml: the
# dependency layer, minutes). Part 1 runs only when $DEBIAN_IMAGE does not exist.
#
# Needs root (debootstrap, image storage in /var/lib/containers) and Debian's buildah, podman and
# debootstrap (tests/container/install_podman.sh installs them). Builds use `--isolation chroot`,
# which works where `podman run` cannot start a container (no setrlimit in a sandbox).
#
# pip inside the builds reaches the index this machine's pip uses: this machine's CA bundle (and, for
# another index than PyPI, a pip.conf) is bind-mounted into each RUN step (`buildah bud -v`), never
# copied into a layer, so neither an index credential nor a proxy's CA ends up in the image.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/vit-pipeline:cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/vit-pipeline-base:cpu}
DEBIAN_IMAGE=${DEBIAN_IMAGE:-localhost/vit-pipeline-debian:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
USER_UID=${USER_UID:-1000}
WORK=${VIT_PIPELINE_IMAGE_WORK:-/var/tmp/vit-pipeline-image}   # scratch: debootstrap root, logs (outside the checkout)

log() { echo "build_cpu_image: $*" >&2; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f s", b - a }'; }

for cmd in buildah podman; do
    command -v "$cmd" >/dev/null || { log "needs $cmd (bash tests/container/install_podman.sh)"; exit 2; }
done
[[ $(id -u) -eq 0 ]] || { log "needs root (debootstrap, /var/lib/containers)"; exit 2; }
mkdir -p "$WORK"
start=$(now)

# --- pip's index and CA for the RUN steps (mounted, not copied) ------------------------------------
# This machine's CA bundle replaces the image's during each RUN (a TLS-inspecting proxy's CA reaches
# pip that way; the file exists in the image already, so the mount leaves no trace in a layer).
mounts=()
ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
[[ -f $ca ]] && mounts+=(-v "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
# A package index other than PyPI (PIP_INDEX_URL, or this machine's pip config): a pip.conf mounted
# at /etc/pip.conf (an empty /etc/pip.conf is left behind as the mount point). file:// indexes of
# this machine are not visible inside the build and are left out.
pip_get() { python3 -m pip config get "$1" 2>/dev/null || true; }
index_url=${PIP_INDEX_URL:-$(pip_get global.index-url)}
extra=$(tr ' ' '\n' <<<"${PIP_EXTRA_INDEX_URL:-$(pip_get global.extra-index-url)}" | grep -v -e '^file:' -e '^$' | tr '\n' ' ' || true)
if [[ -n $index_url || -n ${extra// /} ]]; then
    {
        echo "[global]"
        [[ -n $index_url ]] && echo "index-url = $index_url"
        [[ -n ${extra// /} ]] && echo "extra-index-url = $extra"
    } >"$WORK/pip.conf"
    chmod 600 "$WORK/pip.conf"   # may hold an index credential; never copied into the image
    mounts+=(-v "$WORK/pip.conf:/etc/pip.conf:ro")
fi

# --- 1. Debian root file system -> image --------------------------------------------------------------
t=$(now)
if podman image exists "$DEBIAN_IMAGE"; then
    log "1/3 debian: $DEBIAN_IMAGE exists, kept ($(took "$t"))"
else
    command -v debootstrap >/dev/null || { log "needs debootstrap (bash tests/container/install_podman.sh)"; exit 2; }
    root="$WORK/debian-rootfs"
    rm -rf "$root"
    # python3-dev and g++: DeepSpeed JIT-compiles its CPU shared-memory all-reduce on first use.
    debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,g++,ca-certificates \
        bookworm "$root" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log" >&2; log "debootstrap failed (log: $WORK/debootstrap.log)"; exit 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import --quiet - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$root"
    log "1/3 debian: debootstrap bookworm + podman import -> $DEBIAN_IMAGE ($(took "$t"))"
fi

# --- 2. CPU base: Python + torch/torchvision at the constraints' versions ------------------------------
pin() { sed -n "s/^$1==//p" constraints.txt; }
torch_version=$(pin torch)
torchvision_version=$(pin torchvision)
[[ -n $torch_version && -n $torchvision_version ]] || { log "constraints.txt pins no torch/torchvision"; exit 1; }
t=$(now)
empty="$WORK/empty-context"   # the base copies nothing: an empty context keeps its cache key stable
mkdir -p "$empty"
buildah bud --isolation chroot --layers --format docker "${mounts[@]}" -f docker/cpu-base.Dockerfile \
    --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" \
    --build-arg TORCH_VERSION="$torch_version" --build-arg TORCHVISION_VERSION="$torchvision_version" \
    -t "$BASE_IMAGE" "$empty" >"$WORK/base.log" 2>&1 \
    || { tail -30 "$WORK/base.log" >&2; log "docker/cpu-base.Dockerfile failed (log: $WORK/base.log)"; exit 1; }
log "2/3 base: torch $torch_version, torchvision $torchvision_version -> $BASE_IMAGE ($(took "$t"))"

# --- 3. the project's Dockerfile on top --------------------------------------------------------------
t=$(now)
buildah bud --isolation chroot --layers --format docker "${mounts[@]}" -f docker/Dockerfile \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg USER_UID="$USER_UID" \
    -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
    || { tail -30 "$WORK/build.log" >&2; log "docker/Dockerfile failed (log: $WORK/build.log)"; exit 1; }
cached=$(grep -c 'Using cache' "$WORK/build.log" || true)
log "3/3 image: docker/Dockerfile (BASE_IMAGE=$BASE_IMAGE, $cached steps from cache) -> $IMAGE ($(took "$t"))"
log "done in $(took "$start"): $(podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$IMAGE")"
