"""Precision schedules ([[quantize.phases]], [quantize.eval]): resolution, phase steps, one-line errors."""

import pytest

from low_bits_training.config.quantize import Phase, PlanChange, QuantizeConfig, QuantRule
from low_bits_training.config.tree import apply_dict, build_dataclass
from low_bits_training.errors import ConfigError
from low_bits_training.nn.hardware import Hardware
from low_bits_training.plan.resolve import LayerShape, resolve_plan
from low_bits_training.plan.schedule import check_switchable, first_step, resolve_schedule

LAYERS = {
    f"layers.{i}.{n}": LayerShape(256, 768 if n == "feed_forward.w1" else 256, 256)
    for i in range(4)
    for n in ("attention.wqkv", "feed_forward.w1")
}
LAYERS["lm_head"] = LayerShape(256, 2048, 256)
FWD_HIGH = QuantRule(roles=["forward.*"], format="high")


def label(plans, fqn, role):
    s = plans[fqn].spec(role)
    return "high" if s is None else s.short()


@pytest.mark.parametrize(
    ("start", "steps", "first"),
    [
        (0, 100, 1),
        (90, 100, 91),
        (99, 100, 100),
        (0.9, 100, 91),
        (0.0, 100, 1),
        (0.29, 100, 30),
        (0.85, 10, 10),
    ],
)
def test_start_is_a_step_count_or_a_fraction(start, steps, first):
    # 0.29 * 100 is 28.999999999999996 in floating point: the fraction still means "after 29 steps"
    assert first_step(start, steps, "quantize.phases[0]") == first


def test_phases_replace_the_keys_they_give():
    cfg = QuantizeConfig(
        recipe="mxfp8",
        rules=[QuantRule(layers=["layers.0.*"], format="high")],
        phases=[Phase(start=0.5, rules=[FWD_HIGH]), Phase(start=0.75, recipe="bf16")],
        eval=PlanChange(recipe="fp8_rowwise"),
    )
    s = resolve_schedule(cfg, LAYERS, steps=100)
    assert [(p.label, p.first_step) for p in s.phases] == [
        ("quantize", 1),
        ("quantize.phases[0]", 51),
        ("quantize.phases[1]", 76),
    ]
    assert [s.at(n).label for n in (1, 50, 51, 75, 76, 100)] == [
        "quantize",
        "quantize",
        "quantize.phases[0]",
        "quantize.phases[0]",
        "quantize.phases[1]",
        "quantize.phases[1]",
    ]
    base, fwd, bf16 = (p.plans for p in s.phases)
    assert base == resolve_plan(QuantizeConfig(recipe="mxfp8", rules=cfg.rules), LAYERS)
    # phase 0 gives rules: they replace the base's (layers.0 is quantized again, forward high everywhere)
    assert label(fwd, "layers.0.attention.wqkv", "forward.input") == "high"
    assert label(fwd, "layers.0.attention.wqkv", "wgrad.input").startswith("e4m3/block32@0")
    assert label(base, "layers.0.attention.wqkv", "wgrad.input") == "high"
    assert all(p.is_high_precision for p in bf16.values())
    assert label(s.eval.plans, "layers.3.feed_forward.w1", "forward.input").startswith("e4m3/axis")
    assert s.last_step(s.phases[0]) == 50 and s.last_step(s.phases[2]) == 100
    assert s.changing() == [f for f in LAYERS if f != "lm_head"]
    assert "lm_head" not in s.quantized()  # skipped in every plan: stays a plain Linear


def test_a_phase_from_step_zero_replaces_the_base_and_one_plan_means_no_schedule():
    s = resolve_schedule(QuantizeConfig(recipe="mxfp8", phases=[Phase(start=0, recipe="int8")]), LAYERS, 10)
    assert [p.label for p in s.phases] == ["quantize.phases[0]"] and s.at(1).label == "quantize.phases[0]"
    plain = resolve_schedule(QuantizeConfig(recipe="mxfp8"), LAYERS, 10)
    assert len(plain.all()) == 1 and plain.changing() == [] and plain.eval is None


def test_toml_shape_builds_through_the_tree_layer():
    cfg = QuantizeConfig()
    apply_dict(
        cfg,
        {
            "recipe": "nvfp4",
            "phases": [{"start": 0.9, "rules": [{"roles": ["forward.*"], "format": "high"}]}, {"start": 95}],
            "eval": {"recipe": "bf16"},
        },
        "quantize",
    )
    assert cfg.phases[0].start == 0.9 and isinstance(cfg.phases[1].start, int)
    assert cfg.phases[0].rules[0].format == "high" and cfg.phases[0].recipe is None
    assert cfg.eval.recipe == "bf16"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: QuantizeConfig(phases=[Phase(start=100, recipe="bf16")]),
            "quantize.phases[0].start = 100: expected a step count (int, 0 <= start < training.steps = 100) "
            "or a fraction of training (float, 0 <= start < 1)",
        ),
        (
            lambda: QuantizeConfig(phases=[Phase(start=1.0, recipe="bf16")]),
            "quantize.phases[0].start = 1.0: expected",
        ),
        (
            lambda: QuantizeConfig(phases=[Phase(start=-0.5, recipe="bf16")]),
            "quantize.phases[0].start = -0.5: expected",
        ),
        (lambda: QuantizeConfig(phases=[Phase(recipe="bf16")]), "quantize.phases[0].start = -1: expected"),
        (
            lambda: QuantizeConfig(phases=[Phase(start=0.8, recipe="bf16"), Phase(start=0.5, recipe="int8")]),
            "quantize.phases[1].start = 0.5 (step 51) starts before quantize.phases[0].start = 0.8 (step 81): "
            "phases must not overlap",
        ),
        (
            lambda: QuantizeConfig(phases=[Phase(start=0.8, recipe="bf16"), Phase(start=80, recipe="int8")]),
            "quantize.phases[1].start = 80 (step 81) starts where quantize.phases[0].start = 0.8 (step 81)",
        ),
        (
            lambda: QuantizeConfig(phases=[Phase(start=5)]),
            "quantize.phases[0]: changes nothing; give recipe, rules or skip",
        ),
        (
            # as TOML builds it: refused when the section is built, under the phase's own key
            lambda: build_dataclass(QuantizeConfig, {"phases": [{"start": 5, "recipe": "fp3"}]}, "quantize"),
            "quantize.phases[0].recipe = 'fp3': expected one of bf16,",
        ),
        (
            lambda: QuantizeConfig(phases=[Phase(start=5, rules=[QuantRule(layers=["layers.*.attn.*"])])]),
            "quantize.phases[0].rules[0].layers: 'layers.*.attn.*' matches no linear layer",
        ),
        (
            lambda: QuantizeConfig(eval=PlanChange(skip=["decoder"])),
            "quantize.eval.skip: 'decoder' matches no linear layer",
        ),
        (
            # 48 tokens: a 32-block of the weight-gradient GEMM's token dim does not fit, in that phase only
            lambda: QuantizeConfig(phases=[Phase(start=5, recipe="mxfp8")]),
            "quantize.phases[0]: layers.0.attention.wqkv wgrad.grad_output (48, 256)",
        ),
    ],
)
def test_one_line_errors(make, message):
    layers = LAYERS
    if "(48, 256)" in message:
        layers = {f: LayerShape(s.in_features, s.out_features, 48) for f, s in LAYERS.items()}
    with pytest.raises(ConfigError) as e:
        resolve_schedule(make(), layers, steps=100)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_layer_whose_plan_changes_cannot_be_torchaos_or_an_expert():
    sm90 = Hardware("cuda", (9, 0))
    cfg = QuantizeConfig(recipe="fp8_rowwise", phases=[Phase(start=0.9, recipe="bf16")])
    s = resolve_schedule(cfg, LAYERS, 100, sm90)  # auto on SM90: torchao's Float8Linear for fp8_rowwise
    with pytest.raises(
        ConfigError,
        match=r"^quantize\.phases\[0\]: changes the plan of layers\.0\.attention\.wqkv, "
        r"which torchao's module runs in quantize .*set quantize\.backend = 'emulate'",
    ):
        check_switchable(s, {})
    # the same schedule under our emulation switches
    check_switchable(
        resolve_schedule(QuantizeConfig(**{**_fields(cfg), "backend": "emulate"}), LAYERS, 100, sm90), {}
    )
    # a layer whose plan is the same in every phase may stay torchao's
    same = QuantizeConfig(recipe="fp8_rowwise", phases=[Phase(start=0.9, recipe="fp8_rowwise")])
    check_switchable(resolve_schedule(same, LAYERS, 100, sm90), {})
    with pytest.raises(
        ConfigError, match=r"^quantize\.eval: changes the plan of layers\.0\.feed_forward\.w1 \(an MoE"
    ):
        check_switchable(
            resolve_schedule(QuantizeConfig(recipe="mxfp8", eval=PlanChange(recipe="bf16")), LAYERS, 100),
            {"layers.0.feed_forward.w1": "an MoE expert weight"},
        )


def _fields(cfg):
    return {k: getattr(cfg, k) for k in ("recipe", "rules", "skip", "phases", "eval")}


def test_compiled_runs_round_as_eager_when_a_target_is_emulated():
    """``round_as_eager`` turns inductor's ``emulate_precision_casts`` on when some phase emulates a target
    (activation checkpointing then cannot change a compiled forward's numbers: tests/titan/runtime/test_ac_train.py)
    and leaves it alone for an all-high-precision run."""
    import torch._inductor.config as inductor

    from low_bits_training.titan.targets.schedule import round_as_eager

    # The config module's own patch, not pytest's monkeypatch: from pytest 9.2 monkeypatch undoes a setting it
    # cannot find in the module's __dict__ with delattr, which hides the setting from every later compile
    # in the process ("emulate_precision_casts does not exist": CI of stop 34).
    switches = ("emulate_precision_casts", "eager_numerics.division_rounding", "eager_numerics.disable_ftz")

    def now():
        numerics = inductor.eager_numerics
        return (inductor.emulate_precision_casts, numerics.division_rounding, numerics.disable_ftz)

    with inductor.patch(dict.fromkeys(switches, False)):
        assert not round_as_eager(resolve_schedule(QuantizeConfig(recipe="bf16", skip=[]), LAYERS, 100))
        assert now() == (False, False, False)
        late = QuantizeConfig(recipe="bf16", skip=[], phases=[Phase(start=0.5, recipe="mxfp8")])
        assert round_as_eager(resolve_schedule(late, LAYERS, 100))  # emulated in a later phase only
        # eager's casts on a GPU too: correctly rounded fp32 divides, subnormals kept (Triton's defaults
        # are an approximate divide and flush-to-zero)
        assert now() == (True, True, True)
