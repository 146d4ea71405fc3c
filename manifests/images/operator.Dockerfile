# syntax=docker/dockerfile:1.7
# The tokenlane operator: `tokenlane operator` (kopf). No torch, no CUDA: only the base
# dependencies and the [operator] extra (tests/manifests/test_images.py checks this file never
# installs them; tests/images builds it and proves `import torch` fails inside).
# Build from the repository root with scripts/build-images.sh (docker, podman or buildah), or:
#   docker build -f manifests/images/operator.Dockerfile -t ghcr.io/tokenlane/tokenlane-operator:0.1.0 .

# Debian 12 (its python3 is 3.11). Pinned by digest: the tag is for people, the digest is what
# the engine pulls. Any Debian-family image with apt works (scripts/build-images.sh --debian-base).
ARG BASE_IMAGE=debian:bookworm-slim@sha256:d5d3f9c23164ea16f31852f95bd5959aad1c5e854332fe00f7b3a20fcc9f635c

# ---- build: a virtualenv with tokenlane and the [operator] extra
FROM ${BASE_IMAGE} AS build
# pip's index and mirrors for this stage only: unset unless given (scripts/build-images.sh
# --host-pip forwards the build machine's). A CA bundle for them (a proxy's, say) comes as the
# build secret `pip-cert`, mounted only while pip runs.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tokenlane
ENV PATH=/opt/tokenlane/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY runtime ./runtime
COPY bench ./bench
COPY kernels ./kernels
COPY operator ./operator
# The operator imports tokenlane.runtime.config (the runtime.yaml schema), which needs no torch.
RUN --mount=type=secret,id=pip-cert,target=/run/secrets/pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
 && pip install ".[operator]" \
 && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch leaked in'" \
 && tokenlane --help >/dev/null

# ---- operator image
FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="tokenlane-operator" \
      org.opencontainers.image.description="The tokenlane Kubernetes operator (kopf)" \
      org.opencontainers.image.source="https://github.com/tokenlane/tokenlane" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
ENV DEBIAN_FRONTEND=noninteractive
# The virtualenv's python is a link to the base's /usr/bin/python3, so the same base runs it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/tokenlane /opt/tokenlane
# A numeric non-root user, so Kubernetes can verify runAsNonRoot.
RUN groupadd --gid 10001 tokenlane \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tokenlane
ENV PATH=/opt/tokenlane/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
# 8080: kopf's liveness endpoint (/healthz); 9090: the operator's Prometheus metrics.
EXPOSE 8080 9090
ENTRYPOINT ["tokenlane", "operator"]
