"""The registry of plan targets and the run resolved once (titan/targets/kind.py, titan/targets/registry.py).

Every kind of target (linear, router, experts, attention products, the wire) is one ``TargetKind``; every
tool reads one ``ResolvedRun``; the numerics monitor names a NaN wherever it is born, every kind.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

import pytest

from helpers import REPO, train, write_toml
from low_bits_training.nn.hardware import Hardware
from low_bits_training.plan.resolve import LayerShape, resolve_plan
from low_bits_training.titan.targets import attention, experts, linear, registry, saved, wire

PRESETS = sorted(
    [*REPO.glob("train_configs/debug_*.toml"), *REPO.glob("train_configs/recipes/debug_*.toml")],
    key=lambda p: p.stem,
)
MOE = REPO / "train_configs" / "debug_moe.toml"
FP8_ATTENTION = REPO / "train_configs" / "recipes" / "debug_fp8_attention.toml"


def _load(path: Path, *args: str):
    from low_bits_training.titan.launch.configure import load_config

    return load_config(path, list(args))


def test_every_kind_module_is_one_registry_entry():
    assert registry.TARGETS == (wire.KIND, linear.KIND, experts.KIND, attention.KIND, saved.KIND)
    assert len({k.name for k in registry.TARGETS}) == len(registry.TARGETS)


def test_no_other_module_enumerates_the_kinds():
    # A kind's entry points are called by its own module (its KIND) and nowhere else in the package.
    per_kind = {
        linear: ("linear_entries", "convert_linears", "current_linears", "converted_linears"),
        experts: ("expert_layers", "convert_experts", "expert_plans", "grouped_module_label"),
        attention: ("attention_layers", "convert_attention", "attention_plans", "product_module_label"),
        wire: ("apply_comm",),
        saved: ("with_saved_hooks", "stat_tails", "codec_of"),
    }
    package = REPO / "low_bits_training"
    for module, names in per_kind.items():
        own = Path(inspect.getfile(module))
        for path in package.rglob("*.py"):
            if path == own:
                continue
            text = path.read_text()
            for name in names:
                assert not re.search(rf"\b{name}\(", text), f"{path.relative_to(REPO)} calls {name}"


def test_the_plan_and_what_if_are_resolved_in_one_place():
    # DESIGN: the resolved run is computed once per process; every rank and tool reads ``ResolvedRun``. The
    # schedule (which resolves every phase's plan) and what-if are resolved by the registry alone.
    package = REPO / "low_bits_training"
    callers = {
        name: sorted(
            str(p.relative_to(package))
            for p in package.rglob("*.py")
            if re.search(rf"\b{name}\(", p.read_text()) and f"def {name}(" not in p.read_text()
        )
        for name in ("resolve_whatif", "resolve_schedule")
    }
    assert callers == {
        "resolve_whatif": ["titan/targets/registry.py"],
        "resolve_schedule": ["titan/targets/registry.py"],
    }


def recipe_path(config, run) -> list[str]:
    """The package files, in call order (consecutive calls in one file counted once), of every call that gets
    the run's ``[quantize]`` section or its recipe name as an argument while ``run(config)`` resolves it."""
    q, package = config.quantize, str(REPO / "low_bits_training") + "/"
    stays: list[str] = []

    def profile(frame, event, _arg):
        code = frame.f_code
        if event != "call" or not (code.co_filename or "").startswith(package):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(frame.f_locals.get(n) is q or frame.f_locals.get(n) == q.recipe for n in names):
            rel = code.co_filename[len(package) :]
            if not stays or stays[-1] != rel:
                stays.append(rel)

    sys.setprofile(profile)
    try:
        run(config)
    finally:
        sys.setprofile(None)
    return stays


def test_the_recipe_is_resolved_along_five_files_without_going_back():
    # Issue 41: following quantize.recipe from the resolver entered 13 files with 19 returns to a file already
    # left; now the registry hands it to the schedule, the schedule to the plan resolver, that to the one
    # recipe table; the saved-activation rules read their own section. Each file is entered once.
    config = _load(REPO / "train_configs" / "debug_model.toml", "--quantize.recipe", "mxfp8")
    stays = recipe_path(config, lambda c: registry.resolve_run(c, Hardware()))
    assert stays == ["plan/schedule.py", "plan/resolve.py", "nn/recipes.py", "titan/targets/saved.py"]
    assert len(set(stays)) + 1 <= 5  # and the registry itself


def test_the_recipe_path_counts_a_return_to_a_file_already_left():
    config = _load(REPO / "train_configs" / "debug_model.toml", "--quantize.recipe", "mxfp8")

    def back_and_forth(c):
        resolve_plan(c.quantize, {"lm_head": LayerShape(256, 512, 128)})
        resolve_plan(c.quantize, {"lm_head": LayerShape(256, 512, 128)})

    assert recipe_path(config, back_and_forth) == ["plan/resolve.py", "nn/recipes.py"] * 2


def test_entries_of_the_moe_model_by_kind_and_the_router_stays_high():
    config = _load(MOE)
    shapes, kinds = registry.entries(config)
    by_kind = {}
    for fqn, shape in shapes.items():
        by_kind.setdefault(shape.kind, []).append(fqn)
        assert kinds[fqn].name == {"router": "linear", "qk": "attention", "pv": "attention"}.get(
            shape.kind, shape.kind
        )
    assert len(by_kind["router"]) == 4 and all(f.endswith(".moe.router.gate") for f in by_kind["router"])
    assert len(by_kind["experts"]) == 12 and len(by_kind["qk"]) == len(by_kind["pv"]) == 4
    for recipe in ("mxfp8", "fp8_rowwise", "nvfp4", "int8"):  # router gates (8 outputs) fit no block of 32
        plans = registry.resolve_run(_load(MOE, "--quantize.recipe", recipe)).plans
        assert all(plans[f].is_high_precision for f in by_kind["router"]), recipe
        assert not plans["layers.0.attention.wo"].is_high_precision, recipe


def test_gemm_sizes_count_every_kind_per_token(tmp_path):
    """gemm_sizes.json (the report's FLOP shares): an expert weight's GEMMs run top_k times per token (the
    tiny MoE model routes each token to 2 of 8 experts), an attention product's once per query head, with
    in / out of one head's product (head_dim 32, seq_len)."""
    config = _load(MOE)
    registry.apply_run(config)
    sizes = json.loads(registry.save_plan(config, tmp_path).with_name("gemm_sizes.json").read_text())
    seq = config.training.seq_len
    assert sizes["layers.0.moe.routed_experts.inner_experts.w1"] == [128, 128, 2]
    assert sizes["layers.0.attention.qk"] == [32, seq, 4] and sizes["layers.0.attention.pv"] == [seq, 32, 4]
    assert sizes["layers.0.attention.wo"] == [128, 128, 1] and sizes["layers.0.moe.router.gate"] == [
        128,
        8,
        1,
    ]


def test_a_rule_that_names_the_router_reaches_it():
    from low_bits_training.config.quantize import QuantRule

    config = _load(MOE)
    rule = QuantRule(layers=["layers.0.moe.router.gate"], format="e4m3", scaling="tensor")
    config.quantize.rules = [*config.quantize.rules, rule]
    plans = registry.resolve_run(config).plans
    assert plans["layers.0.moe.router.gate"].specs[0].elem.name == "e4m3"
    assert plans["layers.1.moe.router.gate"].is_high_precision


PHASE_AT_0 = {"phases": [{"start": 0, "recipe": "bf16"}], "recipe": "mxfp8"}


@pytest.mark.parametrize("path", [*PRESETS, "phase-at-step-0"], ids=lambda p: getattr(p, "stem", p))
def test_doctor_equals_launcher_and_resolves_once(tmp_path, monkeypatch, path):
    from low_bits_training.cli.config_checks import checked_config
    from low_bits_training.cli.plan_checks import layer_backends
    from low_bits_training.nn import GEMMS
    from low_bits_training.nn.hardware import detect_hardware
    from low_bits_training.plan.backends import gemm_backend

    monkeypatch.chdir(REPO)
    if path == "phase-at-step-0":  # the launcher trains the phase's plan from step 1: doctor shows it too
        path = write_toml(tmp_path / "phase.toml", quantize=PHASE_AT_0)
    before = registry.RESOLUTIONS[0]
    ngpu = "2" if any(k in path.stem for k in ("tp2", "pp2", "fsdp")) else "1"  # the ranks the preset is for
    status, config = checked_config(str(path), ["--dump_folder", str(tmp_path / "out")], {"NGPU": ngpu})
    assert status.status == "OK", status.detail
    doctor = layer_backends(config, detect_hardware())
    registry.save_plan(config, tmp_path / "run")
    assert registry.RESOLUTIONS[0] - before == 1  # build, doctor's rows and the plan files: one resolution
    plans, labels = registry.current_plans(config)  # what the built model holds, read from its tree
    built = {f: (labels[f], tuple(gemm_backend(p, g) for g in GEMMS)) for f, p in plans.items()}
    assert doctor == built
    if "phase" in path.stem:
        assert all(p.is_high_precision for p in plans.values())
    saved = json.loads((tmp_path / "run" / "precision_plan.json").read_text())
    assert len(saved) == len(plans)


def _stops_at(run, module: str, role: str, step: int = 2) -> None:
    assert run.returncode == 3, run.log[-4000:]
    assert run.log.strip().splitlines()[-1] == (
        f"low-bits-training: stopped: non-finite value (NaN/Inf) first seen at step {step}, "
        f"module {module}, role {role}, rank 0"
    )


NAN_ARGS = ("--override.imports", "tests.titan.nan_override.nan_embedding", "--numerics.nonfinite", "stop")


EXPERT = (MOE, (), "layers.0.moe.routed_experts.inner_experts.w1", "forward.input")
QK = (FP8_ATTENTION, ("--quantize.recipe", "bf16"), "layers.0.attention.qk", "forward.input")


@pytest.mark.parametrize(
    "config,args,module,role,compiled,nproc",
    [(*EXPERT, False, 1), (*QK, False, 1), (*EXPERT, True, 2)],  # compiled on 2 ranks: one kind (3 min)
    ids=["expert-eager-1rank", "qk-eager-1rank", "expert-compiled-2ranks"],
)
def test_a_nan_in_an_expert_or_in_qk_is_named_and_stops(
    tmp_path, config, args, module, role, compiled, nproc
):
    extra = ("--compile.enable",) if compiled else ()
    run = train(
        tmp_path,
        *NAN_ARGS,
        *args,
        *extra,
        "--training.steps",
        "3",
        "--checkpoint.no-enable",
        "--numerics.stats_freq",
        "1",
        config=config,
        nproc=nproc,
        check=False,
        env={"LBT_TEST_NAN_CALL": "2"},  # the embedding's second forward: step 2
    )
    _stops_at(run, module, role)
    rows = [json.loads(line) for line in (run.folder / "numerics.jsonl").read_text().splitlines()]
    named = {r["layer"] for r in rows if r["step"] == 1}  # step 1's statistics cover the target's kind
    kind = module.rsplit(".", 1)[0]
    assert {f"{kind}.{n}" for n in (("w1", "w2", "w3") if "experts" in kind else ("qk", "pv"))} <= named


@pytest.mark.slow  # by hand: ~400 plan resolutions (about a minute), none of what tests/tiers.py looks for
def test_every_recipe_resolves_on_every_debug_preset():
    # ``--quantize.recipe R`` on any debug preset (its own rules kept) is a plan the run can build.
    import dataclasses

    from low_bits_training.nn.recipes import RECIPES

    failures, refused = [], []
    for path in PRESETS:
        config = _load(path)
        for recipe in RECIPES:
            try:
                registry.resolve_run(config, None, dataclasses.replace(config.quantize, recipe=recipe))
            except Exception as e:  # collected: the assertion names every failing pair
                line = f"{path.stem} + {recipe}: {str(e).splitlines()[0]}"
                # backend = 'torchao' refuses a plan torchao runs no layer of (cdba702): by design, one line
                mine = config.quantize.backend == "torchao" and "torchao runs none of this plan" in line
                (refused if mine else failures).append(line)
    assert not failures, "\n".join(failures)
    assert all(r.startswith("debug_torchao_mixed + ") for r in refused), refused
    assert "nvfp4" in {r.split(" + ")[1].split(":")[0] for r in refused}, refused


def test_mxfp8_recipe_trains_on_the_moe_preset(tmp_path):
    run = train(tmp_path, "--quantize.recipe", "mxfp8", "--training.steps", "2", "--checkpoint.no-enable",
                config=MOE)  # fmt: skip
    assert len(run.losses) == 2 and all(v == v for v in run.losses.values())  # finite, both steps
    table = (run.folder / "precision_plan.txt").read_text()
    assert "layers.[0-3].moe.router.gate" in table and "QuantGroupedExperts" in table
