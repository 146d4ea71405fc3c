# syntax=docker/dockerfile:1.7
# The tokenlane operator: `tokenlane operator` (kopf). No torch, no CUDA: only the base
# dependencies and the [operator] extra (tests/manifests checks this file never installs them).
# Build from the repository root:
#   docker build -f manifests/images/operator.Dockerfile -t ghcr.io/tokenlane/tokenlane-operator:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tokenlane
ENV PATH=/opt/tokenlane/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli ./cli
COPY runtime ./runtime
COPY kernels ./kernels
COPY operator ./operator
# The operator imports tokenlane.runtime.config (the runtime.yaml schema), which needs no torch.
RUN pip install ".[operator]" \
 && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch leaked in'" \
 && tokenlane --help >/dev/null

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/tokenlane /opt/tokenlane
RUN groupadd --gid 10001 tokenlane \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tokenlane
ENV PATH=/opt/tokenlane/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
# 8080: kopf's liveness endpoint (/healthz); 9090: the operator's Prometheus metrics.
EXPOSE 8080 9090
ENTRYPOINT ["tokenlane", "operator"]
