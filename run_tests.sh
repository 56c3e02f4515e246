#!/usr/bin/env bash
# Run the tests on CPU (sets up .venv with the [dev] extra on first use).
#   ./run_tests.sh                 # the fast tier: every unit test and one launcher run (-m "not slow or smoke")
#   ./run_tests.sh --all           # everything: launcher runs on 1 and 2 ranks, compile, reliability (CI runs this),
#                                  # in 2 pytest-xdist workers, a test file per worker (LBT_TEST_WORKERS=0: in one)
#   ./run_tests.sh tests/formats   # a part (fast tier; add --all for all of it); any pytest arguments pass through
# "slow" is given at collection by tests/tiers.py (what a test calls), not by hand: tests/conftest.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
tier=(-m "not slow or smoke")
if [[ "${1:-}" == "--all" ]]; then
  # One process used about one of two cores (launcher start-up, imports, inductor are serial); a third worker was not
  # shown faster (one run, not finished). A file's tests stay on one worker, so its module fixtures run once; the longest
  # files go first (tests/conftest.py, file_seconds.json).
  tier=(-n "${LBT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
  shift
fi
source scripts/ensure_venv.sh dev
[[ "${LBT_SETUP_DRY_RUN:-0}" == "1" ]] && exit 0  # the set-up commands were printed; nothing runs
threads=2
if [[ "${tier[0]}" == "-n" ]]; then threads=1; fi  # 2 workers x 1 thread on 2 cores
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}"
exec "$PYTHON" -m pytest ${tier[@]+"${tier[@]}"} "$@"
