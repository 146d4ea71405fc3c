#!/usr/bin/env bash
# Installs everything the demo and the tests need, from nothing: a virtualenv in .venv with
# tokenlane and its extras, and (with --system) Debian's prometheus for the integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--system" ]]; then
  # Debian's prometheus for the integration tests; etcd for the cluster tier's control plane
  # (../shared/k8s/up.sh would install it too, but one apt-get run avoids the dpkg lock race).
  packages=()
  if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then packages+=(prometheus); fi
  if [[ -f ../shared/k8s/up.sh ]] && ! command -v etcd >/dev/null; then packages+=(etcd-server); fi
  if (( ${#packages[@]} )); then
    echo "setup: installing Debian's ${packages[*]} (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null
  fi
fi

PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build on local disk; anything else pulls GBs.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
rm -rf build  # setuptools builds in-tree and never prunes stale modules from build/lib
.venv/bin/pip install -q --disable-pip-version-check ".[runtime,triton,operator,bench,test]"
echo "setup: ready (.venv)" >&2
