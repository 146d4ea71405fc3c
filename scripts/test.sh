#!/usr/bin/env bash
# The test command (README, .ci/run): installs everything, then runs the suite.
# Slow sweeps (-m slow), the real-cluster suite (-m e2e, needs KUBECONFIG) and the container
# images tier (-m images: builds both images with buildah, 10-20 min; see docs/operations.md)
# are opt-in:
#   scripts/test.sh -m slow      scripts/test.sh -m e2e      scripts/test.sh -m images
# -m slow also runs every Hypothesis property with its thorough example count
# (tests/property_examples.py; TOKENLANE_THOROUGH_PROPERTIES=1 does that in any run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --system
export TOKENLANE_TEST_TORCH_THREADS=${TOKENLANE_TEST_TORCH_THREADS:-2}
# The default selection unless the caller picks one with -m: `scripts/test.sh tests/runtime -x`
# leaves the opt-in tiers out too.
for arg in "$@"; do
  if [[ "$arg" == -m* ]]; then
    exec .venv/bin/python -m pytest "$@"
  fi
done
exec .venv/bin/python -m pytest -m "not slow and not e2e and not gpu and not images" "$@"
