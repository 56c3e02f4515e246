#!/usr/bin/env bash
# Download every wheel the GPU check needs beyond torch, for a GPU node without network (docs/speed_model.md,
# "A node without network"). Run where pip reaches PyPI; copy DIR to the node; there:
#   scripts/gpu_check.sh --wheelhouse DIR
# The list: low_bits_training/speed/gpu_check/wheels.txt (binary wheels only, no dependencies followed).
#   scripts/build_wheelhouse.sh --python-version 3.12 --dest /tmp/wheelhouse [--platform manylinux_x86_64]
# Fails (exit 1) when the folder ends up over 64 MiB, the most a device session carries.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
list="$here/low_bits_training/speed/gpu_check/wheels.txt"
pyver="" dest="" platform="manylinux_x86_64" limit_mib=64
usage() { echo "usage: $0 --python-version X.Y --dest DIR [--platform manylinux_x86_64|manylinux_aarch64]" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) pyver="${2:-}"; shift 2 ;;
    --dest) dest="${2:-}"; shift 2 ;;
    --platform) platform="${2:-}"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "build_wheelhouse: config error: unknown argument $1" >&2; usage ;;
  esac
done
[[ -n "$pyver" && -n "$dest" ]] || usage
arch="${platform#manylinux_}"
[[ "$arch" == "x86_64" || "$arch" == "aarch64" ]] || { echo "build_wheelhouse: config error: --platform = '$platform': expected manylinux_x86_64 or manylinux_aarch64" >&2; exit 2; }
# pip matches one platform tag per flag: name every manylinux tag a current wheel may carry.
plats=()
for tag in manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux1 manylinux_2_5; do
  plats+=(--platform "${tag}_${arch}")
done
PYTHON="${PYTHON:-$( [[ -x "$here/.venv/bin/python" ]] && echo "$here/.venv/bin/python" || echo python3)}"
mkdir -p "$dest"
grep -v '^\s*#' "$list" | grep -v '^\s*$' > "$dest/requirements.txt"
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" "${plats[@]}" \
  -d "$dest" -r "$dest/requirements.txt"
kib=$(du -sk "$dest" | cut -f1)
count=$(find "$dest" -maxdepth 1 -name '*.whl' | wc -l)
echo "build_wheelhouse: $count wheels, $((kib / 1024)) MiB ($kib KiB) in $dest"
if (( kib > limit_mib * 1024 )); then
  echo "build_wheelhouse: $dest is over $limit_mib MiB; drop a wheel from $list" >&2
  exit 1
fi
