"""What-if statistics, config side: [numerics] whatif* keys, which layers and roles, one-line errors."""

import pytest

from low_bits_training.config.numerics import NumericsConfig
from low_bits_training.config.quantize import QuantizeConfig
from low_bits_training.config.tree import apply_dict
from low_bits_training.errors import ConfigError
from low_bits_training.nn import ROLE_NAMES, ROLES
from low_bits_training.nn.hardware import Hardware
from low_bits_training.nn.recipes import recipe_specs
from low_bits_training.plan.resolve import LayerShape, resolve_plan
from low_bits_training.plan.whatif import resolve_whatif

LAYERS = {
    f"layers.{i}.{n}": LayerShape(256, 256, 256)
    for i in range(2)
    for n in ("attention.wo", "feed_forward.w2")
}
LAYERS["lm_head"] = LayerShape(256, 2048, 256)
E2M1_B8 = {"format": "e2m1", "scaling": "block", "block_size": 8, "scale_format": "e8m0"}


def _cfg(**kw) -> NumericsConfig:
    cfg = NumericsConfig(stats_freq=1, **kw)
    cfg.check()
    return cfg


def test_recipes_and_custom_specs_per_layer_and_role():
    cfg = _cfg(
        whatif=["nvfp4", "fp8_rowwise_hp_wgrad", "e2m1_b8"],
        whatif_layers=["layers.1.*", "lm_head"],
        whatif_roles=["forward.input", "wgrad.*"],
        whatif_specs={"e2m1_b8": E2M1_B8},
    )
    tables = resolve_whatif(cfg, list(LAYERS), layers=LAYERS)
    assert list(tables) == ["layers.1.attention.wo", "layers.1.feed_forward.w2", "lm_head"]
    t = tables["lm_head"]
    assert t.names == ("nvfp4", "fp8_rowwise_hp_wgrad", "e2m1_b8")
    keep = {"forward.input", "wgrad.grad_output", "wgrad.input"}
    for k, name in enumerate(t.names[:2]):
        want = recipe_specs(name)
        for i, r in enumerate(ROLES):
            spec = want[r.name] if r.name in keep else None
            assert t.specs[k][i] == (None if spec is None else _along(spec, r))
    # the hp_wgrad recipe keeps the weight-gradient GEMM high: only forward.input is measured
    assert [s is not None for s in t.specs[1]] == [True, False, False, False, False, False]
    custom = [s for s in t.specs[2] if s is not None]
    assert [s.short() for s in custom] == [
        "e2m1/block8(e8m0,exact)/rne",
        *["e2m1/block8@0(e8m0,exact)/rne"] * 2,
    ]


def _along(spec, role):
    from low_bits_training.nn.roles import along_contraction

    return along_contraction(spec, role)


def test_toml_shape_and_defaults():
    cfg = NumericsConfig()
    apply_dict(
        cfg,
        {"stats_freq": 5, "whatif": ["mxfp4", "x"], "whatif_specs": {"x": {"format": "e3m2"}}},
        "numerics",
    )
    cfg.check()
    assert cfg.whatif_layers == ["*"] and cfg.whatif_roles == ["*"]
    tables = resolve_whatif(cfg, list(LAYERS))
    assert (
        set(tables) == set(LAYERS) and tables["lm_head"].specs[1][0].short() == "e3m2/tensor(fp32,exact)/rne"
    )
    assert resolve_whatif(NumericsConfig(), list(LAYERS)) == {}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"whatif": ["nvfp5"]}, "numerics.whatif = ['nvfp5']: 'nvfp5' is neither a recipe (bf16, "),
        ({"whatif": ["mxfp4", "mxfp4"]}, "'mxfp4' is listed twice"),
        ({"whatif": ["bf16"]}, "'bf16' keeps every role high; it measures nothing"),
        ({"whatif": ["mxfp4"], "stats_freq": 0}, "needs numerics.stats_freq > 0"),
        (
            {"whatif": [], "whatif_specs": {"b8": E2M1_B8}},
            "numerics.whatif_specs.b8: not listed in numerics.whatif",
        ),
        (
            {"whatif": ["b8"], "whatif_specs": {"b8": {**E2M1_B8, "axis": 0}}},
            "numerics.whatif_specs.b8.axis: not a key",
        ),
        (
            {"whatif": ["b8"], "whatif_specs": {"b8": {"format": "e9m9"}}},
            "numerics.whatif_specs.b8: unknown format",
        ),
        ({"whatif": ["b8"], "whatif_specs": {"b8": {"scaling": "block"}}}, "missing required key 'format'"),
        ({"whatif": ["b8"], "whatif_specs": {"b8": 4}}, "numerics.whatif_specs.b8 = 4: expected a table"),
        (
            {"whatif": ["nvfp4"], "whatif_specs": {"nvfp4": E2M1_B8}},
            "numerics.whatif_specs.nvfp4: the name of a recipe",
        ),
    ],
)
def test_config_errors_are_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        NumericsConfig(**{"stats_freq": 1, **kw}).check()
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kw", "layers", "message"),
    [
        (
            {"whatif_layers": ["layers.*.attn.*"]},
            LAYERS,
            "numerics.whatif_layers: 'layers.*.attn.*' matches no",
        ),
        ({"whatif_roles": ["backward.*"]}, LAYERS, "numerics.whatif.roles: 'backward.*' matches no role"),
        (
            {},
            {f: LayerShape(s.in_features, s.out_features, 24) for f, s in LAYERS.items()},
            "numerics.whatif (mxfp4): layers.0.attention.wo wgrad.grad_output (24, 256)",
        ),
    ],
)
def test_model_errors_are_one_line(kw, layers, message):
    with pytest.raises(ConfigError) as e:
        resolve_whatif(_cfg(whatif=["mxfp4"], **kw), list(layers), layers=layers)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_layers_torchao_runs_are_refused():
    plans = resolve_plan(QuantizeConfig(recipe="fp8_rowwise"), LAYERS, Hardware("cuda", (9, 0)))
    with pytest.raises(
        ConfigError, match=r"^numerics\.whatif_layers: layers\.0\.attention\.wo runs on torchao's"
    ):
        resolve_whatif(_cfg(whatif=["nvfp4"]), list(LAYERS), plans=plans)
    assert list(
        resolve_whatif(_cfg(whatif=["nvfp4"], whatif_layers=["lm_head"]), list(LAYERS), plans=plans)
    ) == ["lm_head"]  # the skipped output projection is ours (high): it may measure


def test_a_pipeline_stage_resolves_its_own_layers_without_errors():
    cfg = _cfg(whatif=["mxfp4"], whatif_layers=["layers.1.*"])
    assert resolve_whatif(cfg, ["layers.0.attention.wo"], strict=False) == {}
    assert ROLE_NAMES[0] == "forward.input"
