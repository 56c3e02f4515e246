"""What autograd keeps from the forward for the backward, per recipe: one training step of the debug model.

Trains the debug model (1 CPU rank, batch 4 x 256, ``--checkpoint.no-enable``) in this process's children,
one per case, and on step 3 counts every tensor a forward saves for its backward
(``torch.autograd.graph.saved_tensors_hooks``): the bytes of the distinct storages (what the step holds; a
tensor several nodes save counts once) and the sum over all saves. ``--keep-merged-cast`` turns off the
compiled backward's fresh cast of W (``nn.functional.recast_under_compile``) to show what torch.compile's
partitioner keeps without it (docs/precision_plan.md, "What a compiled layer keeps for the backward").

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_saved.py --recipes bf16 fp8_tensorwise nvfp4 int8
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_saved.py --recipes int8 --keep-merged-cast
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_saved.py --config-file train_configs/debug_moe.toml \
        --recipes preset                      # the preset's own [quantize] (MXFP8 experts)

Storages are told apart by address, so the numbers move by a MB or two between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter

STEP = 3
"""The step measured (compilation and the first delayed-scaling updates are behind it)."""


def measure(recipe: str, compiled: bool, keep_merged: bool, dump: str, config_file: str) -> dict:
    """Train STEP steps of ``recipe`` in this process; the saved-tensor bytes of step STEP."""
    import torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="localhost")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from low_bits_training.nn import functional
    from low_bits_training.titan.launch import worker
    from low_bits_training.titan.platform import cpu

    if keep_merged:
        functional.recast_under_compile = lambda plan: False
    cpu.install_device_module()
    argv = [
        "--config-file", config_file, "--training.local_batch_size", "4",
        "--training.seq_len", "256", "--checkpoint.no-enable", "--dump_folder", dump,
        "--metrics.no-enable-tensorboard", "--training.steps", str(STEP), "--metrics.log_freq", "100",
        *(["--quantize.recipe", recipe] if recipe != "preset" else []),
        *(["--compile.enable"] if compiled else []),
    ]  # fmt: skip
    trainer = worker.build_config(argv).build()
    step, result = trainer.train_step, {}

    def counted_step(*args, **kwargs):
        if trainer.step != STEP:
            return step(*args, **kwargs)
        storages, by_shape = {}, Counter()

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            by_shape[f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"] += (
                t.numel() * t.element_size()
            )
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = step(*args, **kwargs)
        result.update(
            distinct=sum(storages.values()), total=sum(by_shape.values()), top=by_shape.most_common(6)
        )
        return out

    trainer.train_step = counted_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--recipes",
        nargs="*",
        default=["bf16", "fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4", "int8"],
        help="recipe names, or 'preset' for the config file's own [quantize]",
    )
    p.add_argument("--modes", nargs="*", choices=["eager", "compiled"], default=["compiled"])
    p.add_argument("--config-file", default="train_configs/debug_model.toml")
    p.add_argument(
        "--keep-merged-cast", action="store_true", help="compiled backward without the fresh W cast"
    )
    p.add_argument("--one", nargs=2, metavar=("RECIPE", "MODE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        with tempfile.TemporaryDirectory(prefix="bench_saved_") as dump:
            print(
                "RESULT "
                + json.dumps(
                    measure(a.one[0], a.one[1] == "compiled", a.keep_merged_cast, dump, a.config_file)
                )
            )
        return
    print("| recipe | mode | distinct storages MB | sum over saves MB | largest (shape dtype: MB) |")
    print("|---|---|---:|---:|---|")
    for recipe in a.recipes:
        for mode in a.modes:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                recipe,
                mode,
                "--config-file",
                a.config_file,
                *(["--keep-merged-cast"] * a.keep_merged_cast),
            ]
            run = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
            line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{recipe} {mode} failed:\n{run.stderr[-3000:]}")
            r = json.loads(line.removeprefix("RESULT "))
            top = ", ".join(f"{k}: {v / 1e6:.1f}" for k, v in r["top"][:3])
            print(
                f"| {recipe} | {mode} | {r['distinct'] / 1e6:.1f} | {r['total'] / 1e6:.1f} | {top} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
