# syntax=docker/dockerfile:1.7
# The tokenlane runtime: `tokenlane serve` on a GPU node (torch + triton, CUDA).
# Build from the repository root:
#   docker build -f manifests/images/runtime.Dockerfile -t ghcr.io/tokenlane/tokenlane:0.1.0 .
# (the image ModelService.spec.image defaults to). A CPU-only variant for kind or minikube:
#   docker build -f manifests/images/runtime.Dockerfile --build-arg CUDA_IMAGE=ubuntu:24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#     -t ghcr.io/tokenlane/tokenlane:0.1.0 .
# The operator's Deployment runs it with a read-only root filesystem: everything the process
# writes (Triton's kernel cache, Hugging Face caches) goes to emptyDir mounts (/tmp, /cache);
# the defaults below point there, and the operator's pod spec sets the same variables.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- build: a wheel of tokenlane and a virtualenv with its runtime extras
FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tokenlane
ENV PATH=/opt/tokenlane/bin:$PATH
# torch first, from the CUDA index, pinned like pyproject.toml pins it.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY runtime ./runtime
COPY kernels ./kernels
COPY operator ./operator
RUN pip install ".[runtime,triton]" && python3 -c "import torch, triton, tokenlane.runtime.config"

# ---- runtime image
FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small host-side launcher with the C compiler the first time a kernel
# runs, so gcc and the Python headers stay in the final image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/tokenlane /opt/tokenlane
# A numeric non-root user, so Kubernetes can verify runAsNonRoot.
RUN groupadd --gid 10001 tokenlane \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tokenlane
ENV PATH=/opt/tokenlane/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    HF_HOME=/tmp/huggingface \
    HF_HUB_OFFLINE=1
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["tokenlane", "serve"]
CMD ["--config", "/etc/tokenlane/runtime.yaml", "--host", "0.0.0.0", "--port", "8000"]
