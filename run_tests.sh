#!/usr/bin/env bash
# Run the tests on CPU (sets up .venv with the [dev] extra on first use).
#   ./run_tests.sh                 # the fast tier: every unit test and one launcher run (-m "not slow or smoke")
#   ./run_tests.sh --all           # everything: launcher runs on 1 and 2 ranks, compile, reliability (CI runs this)
#   ./run_tests.sh tests/formats   # a part (fast tier; add --all for all of it); any pytest arguments pass through
# "slow" is given at collection by tests/tiers.py (what a test calls), not by hand: tests/conftest.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
tier=(-m "not slow or smoke")
if [[ "${1:-}" == "--all" ]]; then
  tier=()
  shift
fi
source scripts/ensure_venv.sh dev
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec "$PYTHON" -m pytest ${tier[@]+"${tier[@]}"} "$@"
