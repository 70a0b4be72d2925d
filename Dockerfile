# hvd_sgp images, two targets:
#   gpu (default): CUDA runtime, Python 3.11, PyTorch and TensorFlow GPU builds, Open MPI wheel
#   cpu:           python:3.11-slim and the README's install, pip install ".[all]"
#
#   docker build -t hvd_sgp:gpu .
#   docker build --target cpu -t hvd_sgp:cpu .
#   docker run --gpus all --shm-size=1g hvd_sgp:gpu sgprun -np 8 python examples/pytorch_digits.py
#   docker run --rm hvd_sgp:cpu sgprun --check-build
#
# MPI and NCCL exchange data through /dev/shm within a machine: give the container more than
# Docker's 64 MB default (--shm-size or --ipc=host). The Open MPI wheel is not CUDA-aware, so
# hvd_sgp stages GPU tensors through pinned host memory; mpi/README.md tells how to use a
# CUDA-aware system MPI instead. sgprun runs Open MPI as root (it sets the consent variables).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04

# ---------------------------------------------------------------- CPU image
FROM python:3.11-slim AS cpu

# Take torch's CPU build instead of PyPI's default CUDA build (several GB smaller).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# openssh-client: Open MPI starts the ranks of other hosts over ssh. Apt versions are left to
# the pinned base image's release (DL3008): its archive drops superseded versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-client \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/hvd_sgp
COPY pyproject.toml README.md ./
COPY hvd_sgp ./hvd_sgp
# DL3013 takes ".[all]" for an unpinned registry package; it is this source tree, whose
# dependencies pyproject.toml pins. The line is the README's install command, word for word.
# hadolint ignore=DL3013
RUN pip install ".[all]"
COPY examples ./examples
COPY tests ./tests
COPY mpi ./mpi

CMD ["sgprun", "--check-build"]

# ---------------------------------------------------------------- GPU build stage
FROM ${CUDA_IMAGE} AS gpu-builder

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Ubuntu 22.04 packages Python 3.11 beside its default 3.10. Apt versions are left to the base
# image's release (DL3008), as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

ENV PATH=/opt/venv/bin:${PATH}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hvd_sgp ./hvd_sgp
# The README's install with the GPU frameworks: PyPI's torch is the CUDA build, and
# tensorflow[and-cuda] is the "tensorflow" extra's one TensorFlow with its CUDA libraries.
# Both bring their CUDA libraries as nvidia-* wheels (torch 2.13: CUDA 13, which needs an
# NVIDIA driver >= 580 on the host; TensorFlow: CUDA 12), so the base image's CUDA only has to
# be compatible, not equal.
# DL3013 takes ".[test]" for an unpinned registry package; it is this source tree.
# hadolint ignore=DL3013
RUN pip install "torch==2.13.0" "tensorflow[and-cuda]>=2.16,<3" ".[test]"

# ---------------------------------------------------------------- GPU image
FROM ${CUDA_IMAGE} AS gpu

ENV DEBIAN_FRONTEND=noninteractive
# The venv's interpreter and ssh for Open MPI; apt versions as above (DL3008).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 openssh-client \
    && rm -rf /var/lib/apt/lists/*

COPY --from=gpu-builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}

WORKDIR /opt/hvd_sgp
COPY examples ./examples
COPY tests ./tests
COPY mpi ./mpi

CMD ["sgprun", "--check-build"]
