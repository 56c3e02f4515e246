#!/usr/bin/env bash
# Train with a TOML precision plan on one machine (torchrun, c10d rendezvous).
#
#   ./run_llama_train.sh                                   # debug model on the built-in corpus (CPU is fine)
#   CONFIG_FILE=train_configs/llama3_8b.toml NGPU=8 ./run_llama_train.sh
#   ./run_llama_train.sh --training.steps 4                # extra arguments override the TOML
#
# Environment: CONFIG_FILE (default train_configs/debug_model.toml), NGPU (default: visible GPUs, or 1
# process on CPU), LOG_RANK (default 0; comma list), PYTHON (interpreter; default: .venv, set up on first use),
# LBT_SKIP_SETUP=1 (never create the .venv), LBT_TORCH=keep (create it around the node's own torch, a build for
# its driver: scripts/ensure_venv.sh), LBT_START_METHOD (spawn: each rank a fresh interpreter; on CPU without
# torch.compile the ranks are forks of the launcher by default, which saves the ~8 s of imports per rank).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

# Set ourselves up on a fresh machine: a .venv with the package installed (editable) and its pinned stack.
source scripts/ensure_venv.sh ""
[[ "${LBT_SETUP_DRY_RUN:-0}" == "1" ]] && exit 0  # the set-up commands were printed; nothing runs

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_model.toml}"
if [[ -z "${NGPU:-}" ]]; then
  NGPU="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 1)')"
fi
if [[ ! "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "low-bits-training: config error: NGPU = '$NGPU': expected a positive integer (processes on this machine)" >&2
  exit 2
fi
LOG_RANK="${LOG_RANK:-0}"

# On CPU each rank gets an equal share of the cores (gloo; no oversubscription).
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores="$(nproc 2>/dev/null || echo 1)"
  export OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
fi
export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"

# The launcher checks the whole config here, before any rank starts (bad input: one line, exit code 2, the
# run folder untouched), then runs torchrun in the same process. Exit codes: 0 done, 2 config, 3 non-finite
# stop ([numerics] nonfinite = "stop"), 4 checkpoint refused, 1 crash (README: "Exit codes").
exec "$PYTHON" -m low_bits_training.cli.train \
  --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -- --config-file "$CONFIG_FILE" "$@"
