#!/usr/bin/env bash
# Submit a training run to slurm: torchrun on every node, c10d rendezvous on the first one.
#
#   ./submit.sh                                             # debug model, 1 node x 1 GPU, generated name
#   CONFIG_FILE=train_configs/x.toml NNODES=4 NGPU=8 RUN_NAME=fp8-8b ./submit.sh --training.steps 1000
#   RUN_NAME=fp8-8b ./submit.sh                             # again: resumes outputs/fp8-8b from its checkpoint
#
# Extra arguments are training overrides (as for run_llama_train.sh). Before anything is written or submitted
# the launcher checks the job's config here, for NNODES x NGPU processes (low_bits_training.titan.launch.launcher
# --check-only): bad input is one line and exit code 2 (4 for a checkpoint it could not resume), as on a node.
# The check judges the config, not this machine (a login node has no GPU): each node's launcher judges its own.
# Environment:
#   CONFIG_FILE   TOML (default train_configs/debug_model.toml)
#   NNODES        nodes (default 1)           NGPU  GPUs (processes) per node (default 1; 8 for the GPU presets)
#   RUN_NAME      names the output + checkpoint folder outputs/RUN_NAME; default: WANDB_RUN_NAME, then
#                 WANDB_NAME, then <config>-<date>-<time>. The same name resumes that run's last checkpoint.
#   OUTPUT_ROOT   where run folders live (default outputs)
#   ENV_FILE      your own variables (default .env): sourced here, never printed.
#   Secrets: every variable whose name holds TOKEN, KEY, SECRET, PASSWORD, PASSWD or CREDENTIAL, from .env
#                 or exported in your shell (WANDB_API_KEY, HF_TOKEN, ...), is kept out of the environment
#                 sbatch records: it goes to LBT_SECRETS_DIR/RUN_NAME.env (default
#                 ~/.cache/low-bits-training/secrets, mode 600, kept for requeues; delete it when the run is
#                 done) and only the job's nodes read it.
#   SBATCH_*      any sbatch option slurm reads from the environment (SBATCH_PARTITION, SBATCH_TIMELIMIT,
#                 SBATCH_ACCOUNT, ...); may be set in .env.
#   SBATCH_SCRIPT batch script (default scripts/slurm/train.sbatch)
#   DRY_RUN=1     check the config and print the sbatch command; nothing is written or submitted
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

ENV_FILE="${ENV_FILE:-.env}"
if [[ -f "$ENV_FILE" ]]; then
  set -a
  # shellcheck disable=SC1090
  source "$ENV_FILE"
  set +a
fi

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_model.toml}"
NNODES="${NNODES:-1}"
NGPU="${NGPU:-1}"
OUTPUT_ROOT="${OUTPUT_ROOT:-outputs}"
SBATCH_SCRIPT="${SBATCH_SCRIPT:-scripts/slurm/train.sbatch}"
if [[ ! -f "$CONFIG_FILE" ]]; then
  echo "submit.sh: CONFIG_FILE = '$CONFIG_FILE': no such file" >&2; exit 2
fi
for v in NNODES NGPU; do
  if [[ ! "${!v}" =~ ^[1-9][0-9]*$ ]]; then
    echo "submit.sh: $v = '${!v}': expected a positive integer" >&2; exit 2
  fi
done

RUN_NAME="${RUN_NAME:-${WANDB_RUN_NAME:-${WANDB_NAME:-}}}"
if [[ -z "$RUN_NAME" ]]; then
  RUN_NAME="$(basename "$CONFIG_FILE" .toml)-$(date +%Y%m%d-%H%M%S)"
fi
if [[ ! "$RUN_NAME" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
  echo "submit.sh: RUN_NAME = '$RUN_NAME': use letters, digits, '.', '_' and '-' (it names a folder)" >&2; exit 2
fi
DUMP_FOLDER="$OUTPUT_ROOT/$RUN_NAME"
if [[ -d "$DUMP_FOLDER/checkpoint" ]]; then
  echo "submit.sh: $DUMP_FOLDER/checkpoint exists: this run resumes from its last checkpoint" >&2
fi

# shellcheck source=scripts/ensure_venv.sh
source scripts/ensure_venv.sh ""
[[ "${LBT_SETUP_DRY_RUN:-0}" == "1" ]] && exit 0  # the set-up commands were printed; nothing runs

# The launcher's own check, with the training arguments train.sbatch gives it on the nodes.
"$PYTHON" -m low_bits_training.titan.launch.launcher --check-only --nnodes="$NNODES" --nproc_per_node="$NGPU" \
  -- --config-file "$CONFIG_FILE" --job.name "$RUN_NAME" --dump_folder "$DUMP_FOLDER" --checkpoint.enable "$@"

# What the batch script needs; W&B names (and resumes) the run after the folder.
export LBT_REPO="$here" LBT_RUN_NAME="$RUN_NAME" LBT_DUMP_FOLDER="$DUMP_FOLDER"
export CONFIG_FILE PYTHON
export WANDB_RUN_NAME="${WANDB_RUN_NAME:-$RUN_NAME}" WANDB_RUN_ID="${WANDB_RUN_ID:-$RUN_NAME}"
export WANDB_RESUME="${WANDB_RESUME:-allow}"

# Secrets, wherever they were set (.env or the shell): names only here, values only into a file of mode 600
# that the batch script reads on the nodes; then they leave this environment, which sbatch records.
mapfile -t secret_names < <(compgen -e | grep -iE 'TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL' \
  | grep -vE '^(SLURM|SBATCH|LBT)_' || true)
export LBT_SECRETS_FILE=""
if (( ${#secret_names[@]} )) && [[ "${DRY_RUN:-0}" != "1" ]]; then
  secrets_dir="${LBT_SECRETS_DIR:-$HOME/.cache/low-bits-training/secrets}"
  (umask 077 && mkdir -p "$secrets_dir")
  LBT_SECRETS_FILE="$secrets_dir/$RUN_NAME.env"
  (umask 077 && for name in "${secret_names[@]}"; do printf 'export %s=%q\n' "$name" "${!name}"; done \
    > "$LBT_SECRETS_FILE")
fi
for name in "${secret_names[@]}"; do
  unset "$name"
done

cmd=(sbatch "--job-name=$RUN_NAME" "--nodes=$NNODES" --ntasks-per-node=1 "--gpus-per-node=$NGPU"
     "--output=$DUMP_FOLDER/slurm/%j.out" --open-mode=append --requeue --export=ALL
     "$SBATCH_SCRIPT" "$@")
if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
mkdir -p "$DUMP_FOLDER/slurm"
"${cmd[@]}"
echo "submit.sh: run '$RUN_NAME' -> $DUMP_FOLDER (resubmit with RUN_NAME=$RUN_NAME to resume)" >&2
