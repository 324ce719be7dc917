#!/usr/bin/env bash
# Run the fedcomp Flower app as a sandboxed local simulation and check that it completed.
#
#   scripts/flwr_sim.sh [APP_DIR] [-n NUM_SUPERNODES] [-t TIMEOUT_S] [-c "key=value ..."]...
#   scripts/flwr_sim.sh -n 10 -c "dataset='mnist' data-dir='/work/shared/data'"
#
# Starts its own SuperLink on a free port with a temporary FLWR_HOME (telemetry, update check
# and runtime `uv sync` off), runs `flwr run --stream`, checks results.json (flwr run exits 0
# even when the run failed) and stops every process it started. Exit code 0 = run completed.
# Results go to results-dir, else $FEDCOMP_RESULTS_DIR, else ./results (of the caller's cwd).
# See fedcomp/testing/flower.py (run_simulation) for the details. For interactive use,
# `python -m fedcomp run` (fedcomp/cli.py) runs the same sandbox after validating the run config,
# with a quiet table and exit codes 0 completed / 1 failed / 2 bad configuration.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" FEDCOMP_APP_DIR="${FEDCOMP_APP_DIR:-$root}"
exec python -m fedcomp.testing.flower "$@"
