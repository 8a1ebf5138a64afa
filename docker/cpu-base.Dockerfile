# A CPU stand-in for the CUDA PyTorch base of docker/Dockerfile, for machines that cannot pull
# pytorch/pytorch (no registry reachable) or have no GPU: Debian + Python + torch/torchvision at the
# versions constraints.txt pins. docker/build_cpu_image.sh builds it and passes it to docker/Dockerfile
# as BASE_IMAGE; see docker/README.md ("Tested here: the CPU image").
#
# Like the official image it has one Python environment on PATH (a venv in /opt/venv where that image
# has conda in /opt/conda) with torch and torchvision installed, and root may pip-install into it.
# Unlike the runtime image it has g++ and the Python headers (from DEBIAN_IMAGE, which
# build_cpu_image.sh debootstraps): on CPU, DeepSpeed JIT-compiles its shared-memory all-reduce
# at the first multi-rank run.

ARG DEBIAN_IMAGE=localhost/vit-pipeline-debian:bookworm
FROM ${DEBIAN_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Passed by build_cpu_image.sh from constraints.txt, so this layer changes only when they do.
ARG TORCH_VERSION
ARG TORCHVISION_VERSION

ENV PATH=/opt/venv/bin:${PATH} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Build tools as the official image has them (DeepSpeed is built from source, without isolation).
# The CUDA build from PyPI (the only torch 2.x wheel there for x86_64 Linux): it runs on the CPU, and
# its nvidia-* libraries are the versions constraints.txt lists, so docker/Dockerfile keeps them all.
RUN test -n "${TORCH_VERSION}" && test -n "${TORCHVISION_VERSION}" \
    && python3 -m venv /opt/venv \
    && python -m pip install pip==26.3 setuptools==84.2.1 wheel==0.48.0 \
    && python -m pip install "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    && python -c "import torch, torchvision; print('base: torch', torch.__version__, 'torchvision', torchvision.__version__)"
