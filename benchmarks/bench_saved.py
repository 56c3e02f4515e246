"""What autograd keeps from the forward for the backward, per recipe: one training step of the debug model.

Trains the debug model (1 CPU rank, batch 4 x 256, ``--checkpoint.no-enable``) in this process's children,
one per case, and on step 3 counts every tensor a forward saves for its backward
(``torch.autograd.graph.saved_tensors_hooks``): the bytes of the distinct storages (what the step holds; a
tensor several nodes save counts once) and the sum over all saves. What ``[[quantize.saved]]`` packs is out of
this hook's sight (the rule's own hooks, inside the module, take those saves): the run's own count of it
(``saved/bytes``, codes and scales as stored, and ``saved/bytes_hp``, as the forward made them) is added as
two columns, and "held" is the distinct storages plus the stored bytes. ``--saved FORMAT ...`` trains each
case once more per format with one rule, ``modules = ["layers.*"]`` in that format (its defaults: one scale
per row for an 8-bit format). ``--keep-merged-cast`` turns off the
compiled backward's fresh cast of W (``nn.functional.recast_under_compile``) to show what torch.compile's
partitioner keeps without it (docs/precision_plan.md, "What a compiled layer keeps for the backward").

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_saved.py --recipes bf16 fp8_tensorwise nvfp4 int8
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_saved.py --recipes int8 --keep-merged-cast
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_saved.py --config-file train_configs/debug_moe.toml \
        --recipes preset                      # the preset's own [quantize] (MXFP8 experts)
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_saved.py --recipes preset --modes eager compiled \
        --saved high bf16 e4m3 e4m3/tensor     # [[quantize.saved]] rules on every block

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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STEP = 3
"""The step measured (compilation and the first delayed-scaling updates are behind it)."""


def _with_rule(config_file: str, fmt: str, folder: Path) -> Path:
    """A copy of ``config_file`` with one ``[[quantize.saved]]`` rule: every block's saves in ``fmt``
    (``e4m3``, or ``e4m3/tensor``: a format and a scaling)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import write_toml

    name, _, scaling = fmt.partition("/")
    rule = {"modules": ["layers.*"], "format": name, **({"scaling": scaling} if scaling else {})}
    return write_toml(folder / f"saved_{name}_{scaling}.toml", REPO / config_file, quantize={"saved": [rule]})


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
    from low_bits_training.titan.runtime import trainer as trainer_module

    argv = [
        "--config-file", config_file, "--training.local_batch_size", "4",
        "--training.seq_len", "256", "--checkpoint.no-enable", "--dump_folder", dump,
        "--metrics.no-enable-tensorboard", "--training.steps", str(STEP), "--metrics.log_freq", "100",
        *(["--quantize.recipe", recipe] if recipe != "preset" else []),
        *(["--compile.enable"] if compiled else []),
    ]  # fmt: skip
    trainer = worker.build_config(argv).build()
    step, training = trainer.train_step, trainer.config.training
    result = {"tokens": training.local_batch_size * training.seq_len}

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

    log_saved = trainer_module.log_saved_bytes

    def counted_saved(t):
        per_token = log_saved(t)
        if t.step == STEP and per_token:
            result.update(
                rule_stored=per_token["stored"] * result["tokens"],
                rule_made=per_token["as_made"] * result["tokens"],
            )
        return per_token

    trainer_module.log_saved_bytes = counted_saved
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
    p.add_argument(
        "--saved", nargs="*", default=[], metavar="FORMAT",
        help="also train each case with one [[quantize.saved]] rule on layers.* in each FORMAT "
        "(a format, or format/scaling: e4m3/tensor)",
    )  # fmt: skip
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
    print(
        "| recipe | mode | saves | distinct storages MB | sum over saves MB | [[quantize.saved]] stored MB | "
        "as made MB | held MB | held B/token | largest (shape dtype: MB) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    tmp = tempfile.TemporaryDirectory(prefix="bench_saved_rules_")
    for recipe, mode, saved in [(r, m, s) for r in a.recipes for m in a.modes for s in [None, *a.saved]]:
        config = a.config_file if saved is None else _with_rule(a.config_file, saved, Path(tmp.name))
        cmd = [
            sys.executable, __file__, "--one", recipe, mode, "--config-file", str(config),
            *(["--keep-merged-cast"] * a.keep_merged_cast),
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{recipe} {mode} failed:\n{run.stderr[-3000:]}")
        r = json.loads(line.removeprefix("RESULT "))
        top = ", ".join(f"{k}: {v / 1e6:.1f}" for k, v in r["top"][:3])
        stored, made = r.get("rule_stored", 0), r.get("rule_made", 0)
        held = r["distinct"] + stored
        rule = "-" if saved is None else f"layers.* {saved}"
        print(
            f"| {recipe} | {mode} | {rule} | {r['distinct'] / 1e6:.1f} | {r['total'] / 1e6:.1f} | "
            f"{stored / 1e6:.1f} | {made / 1e6:.1f} | {held / 1e6:.1f} | {held / r['tokens']:,.0f} | {top} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
