#!/usr/bin/env bash
# Record every debug preset for a refactoring's "no behaviour change" check (issue 41):
#   scripts/record_presets.sh OUT [STEPS]     # each preset STEPS steps (default 4), checkpoints at half and end
#   ... change the code ...
#   scripts/record_presets.sh OUT2 && .venv/bin/python scripts/compare_runs.py OUT OUT2
# Presets: train_configs/debug_*.toml, recipes/*.toml, optim/*.toml (2 processes for pp2 / tp2 / fsdp).
# It runs this checkout's code: record the "before" from a worktree of the old commit (git worktree add) with
# PYTHONPATH pointing at it, or before you edit anything. About 10 minutes on 2 cores.
set -uo pipefail
out="${1:?usage: scripts/record_presets.sh OUT [STEPS]}"; steps="${2:-4}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$out"
for cfg in train_configs/debug_*.toml train_configs/recipes/*.toml train_configs/optim/*.toml; do
  name=$(basename "$cfg" .toml)
  n=1; [[ "$name" == *pp2* || "$name" == *tp2* || "$name" == *fsdp* ]] && n=2
  CONFIG_FILE="$cfg" NGPU=$n LBT_SKIP_SETUP=1 ./run_llama_train.sh --training.steps "$steps" \
    --checkpoint.enable --checkpoint.interval $(( steps / 2 > 0 ? steps / 2 : 1 )) \
    --dump_folder "$out/$name" --metrics.log_freq 1 >"$out/$name.log" 2>&1
  echo "$name rc=$?"
done
