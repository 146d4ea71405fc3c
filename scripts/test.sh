#!/usr/bin/env bash
# The test command (README, .ci/run): installs everything, then runs the suite.
# Slow sweeps (-m slow) and the real-cluster suite (-m e2e, needs KUBECONFIG) are opt-in:
#   scripts/test.sh -m slow      scripts/test.sh -m e2e
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --system
export TOKENLANE_TEST_TORCH_THREADS=${TOKENLANE_TEST_TORCH_THREADS:-2}
if [[ $# -eq 0 ]]; then
  set -- -m "not slow and not e2e and not gpu"
fi
exec .venv/bin/python -m pytest "$@"
