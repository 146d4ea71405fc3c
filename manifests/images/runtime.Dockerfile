# syntax=docker/dockerfile:1.7
# The tokenlane runtime: `tokenlane serve` on a GPU node (torch + triton, CUDA), the image
# ModelService.spec.image defaults to. Build from the repository root with
# scripts/build-images.sh (docker, podman or buildah; `--variant cpu` for kind or minikube), or:
#   docker build -f manifests/images/runtime.Dockerfile -t ghcr.io/tokenlane/tokenlane:0.1.0 .
# The operator's Deployment runs it with a read-only root filesystem: everything the process
# writes (Triton's kernel cache, Hugging Face caches) goes to emptyDir mounts (/tmp, /cache);
# the defaults below point there, and the operator's pod spec sets the same variables.

# Pinned by digest: the tag is for people, the digest is what the engine pulls. The torch index
# below must match its CUDA version (cu128 for 12.8). The CPU variant replaces it with a
# Debian-family image (scripts/build-images.sh --variant cpu).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04@sha256:ebef3c171eeef0298e4eb2e4be843105edf3b8b0ac45e0b43acee358e8046867

# Extra wheels for pip (its --find-links), e.g. a torch CPU wheel already on disk. Empty unless
# the build supplies a folder as the named context `wheels` (--build-context wheels=DIR); it is
# mounted read-only for one step, so no path and no wheel ends up in the image.
FROM scratch AS wheels

# ---- build: a virtualenv with tokenlane and its runtime extras; the C compiler here builds
# the native CPU kernels into the wheel (setup.py: one library per x86-64 level), so the
# runtime image below needs none for them.
FROM ${CUDA_IMAGE} AS build
# pip's index and mirrors for this stage only: unset unless given (scripts/build-images.sh
# --host-pip forwards the build machine's). A CA bundle for them (a proxy's, say) comes as the
# build secret `pip-cert`, mounted only while pip runs.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# runtime,triton,gpu for GPUs (gpu: NVML gauges); the CPU variant drops triton and gpu (CUDA only).
ARG EXTRAS=runtime,triton,gpu
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tokenlane
ENV PATH=/opt/tokenlane/bin:$PATH
# torch first, from the index that matches the base's CUDA, pinned like pyproject.toml pins it.
RUN --mount=type=bind,from=wheels,target=/wheels \
    --mount=type=secret,id=pip-cert,target=/run/secrets/pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && pip install --find-links /wheels --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY cli ./cli
COPY runtime ./runtime
COPY bench ./bench
COPY kernels ./kernels
COPY operator ./operator
RUN --mount=type=secret,id=pip-cert,target=/run/secrets/pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && pip install ".[${EXTRAS}]" \
 && python -c "import torch, tokenlane.runtime.entrypoints.server; print('torch', torch.__version__)" \
 && python -c "from tokenlane.kernels import native_build as b; m = b.read_manifest(); assert m and m['levels'], m; print('native CPU kernels:', ', '.join(m['levels']))" \
 && case ",${EXTRAS}," in *,triton,*) python -c "import triton" ;; esac

# ---- runtime image
FROM ${CUDA_IMAGE}
ARG EXTRAS=runtime,triton,gpu
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tokenlane" \
      org.opencontainers.image.description="The tokenlane runtime: tokenlane serve (torch, Triton)" \
      org.opencontainers.image.source="https://github.com/tokenlane/tokenlane" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small host-side launcher with the C compiler the first time a kernel
# runs, so gcc and the Python headers stay in the final image whenever triton is installed;
# the CPU variant has no compiler. The native CPU kernels came prebuilt in the wheel (the
# engine logs the level it loaded at start-up); libgomp1 is their OpenMP runtime.
RUN compiler="" \
 && case ",${EXTRAS}," in *,triton,*) compiler="gcc libc6-dev python3-dev" ;; esac \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates libgomp1 ${compiler} \
 && rm -rf /var/lib/apt/lists/*
# The virtualenv's python is a link to the base's /usr/bin/python3, so the same base runs it.
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
