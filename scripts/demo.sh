#!/usr/bin/env bash
# The main job on an embedded default: builds a tiny model, serves it with three lanes, runs
# mixed-lane traffic in continuous and static batching, prints the comparison and the chart.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/tokenlane demo "$@"
