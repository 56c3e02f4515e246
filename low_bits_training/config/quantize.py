"""``[quantize]``: the precision plan's section (recipe, backend, skip, rules, torchao options, phases, eval,
comm, saved, autopilot) as typed fields, each checked when built. Schema only: ``plan.resolve`` turns it into
one ``LinearPlan`` per target.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated, ClassVar, Literal, get_args

from low_bits_training.config.autopilot import AutopilotConfig
from low_bits_training.config.comm import CommConfig
from low_bits_training.config.saved import SavedRule
from low_bits_training.config.section import AtLeast, Retired, Section
from low_bits_training.formats.spec import (
    AmaxCompute,
    FourOverSix,
    InfAmax,
    QuantSpec,
    RhtOutput,
    RhtSigns,
    RoundingMode,
    ScaleApply,
    ScaleFormat,
    ScaleMin,
    ScaleOrder,
    ScaleRounding,
    ScaleUnderflow,
    Scaling,
    Source,
    shared_spec_fields,
)
from low_bits_training.nn.recipes import RecipeName

RULE_UNSET_SPEC_FIELDS = ("format", "axis")
"""The ``QuantSpec`` fields a rule does not set by name: ``format`` (it also takes "high"; ``plan.resolve``
reads it apart) and ``axis`` (the GEMM's contraction dim, which the role fixes)."""
RULE_SPEC_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(QuantSpec) if f.name not in RULE_UNSET_SPEC_FIELDS
)
"""The fields of ``QuantRule`` that set a ``QuantSpec`` field of the same name: all of ``QuantSpec``'s but
``RULE_UNSET_SPEC_FIELDS`` (``QuantRule`` must declare each: checked at import)."""


BackendSetting = Literal["emulate", "torchao", "auto"]
"""``[quantize] backend``: emulate (ours everywhere), torchao (torchao's module for every layer whose plan it
has: its kernel where the device has one, else its emulated mode), auto (torchao where the device has the
kernel, ours elsewhere)."""
BACKEND_SETTINGS: tuple[str, ...] = get_args(BackendSetting)
REAL_RETIRED = (
    "the hand-written _scaled_mm backend is a Python-only reference now; real kernels come from torchao"
)
"""Said when a config asks for the retired backend setting ``real``."""


@dataclass(kw_only=True, slots=True)
class TorchaoOptions:
    """``[quantize.torchao]``: torchao's own switches for the layers the torchao backend runs."""

    enable_fsdp_float8_all_gather: bool = False
    """Float8Linear: FSDP2 all-gathers the weight in fp8 (half the bytes of bf16). Needs tensorwise weight
    scaling in every Float8 layer (fp8_tensorwise) and data_parallel_shard_degree > 1 to matter."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With fp8 all-gather: compute every weight's scale in one all-reduce after each optimizer step instead
    of one per layer in forward (torchao's ``precompute_float8_dynamic_scale_for_fsdp``)."""
    float8_fast_accum_forward: bool = True
    """Float8Linear: the forward GEMM accumulates with cuBLAS fast accumulation (torchao's default; the
    backward GEMMs never do). No effect in torchao's emulated mode."""
    pad_inner_dim: bool = False
    """Float8Linear: pad the GEMM's inner dim to a multiple of 16 (torchao ``pad_inner_dim``)."""
    mxfp8_dim0_cast_kernel: Literal["triton", "torch"] = "triton"
    """MXFP8Linear: kernel for MX casts along dim 0 (torchao ``MXFP8Dim0CastKernelChoice``)."""
    mxfp8_dim1_cast_kernel: Literal["cuda", "triton", "torch", "cutedsl"] = "cuda"
    """MXFP8Linear: kernel for MX casts along dim 1 (torchao ``MXFP8Dim1CastKernelChoice``)."""


@dataclass(kw_only=True, slots=True)
class QuantRule(Section):
    """``[[quantize.rules]]``: change some roles of some layers (applied after the recipe, in order).

    A ``Section``: each field is checked when the rule is built (as ``quantize.rules.<key>``; from TOML, and
    inside a ``QuantizeConfig``, under its own index: ``quantize.rules[0].<key>``). What needs the layers or
    the recipe (globs, first_n beyond the blocks, the specs it makes) is checked by ``resolve_plan``.
    """

    SECTION: ClassVar[str] = "quantize.rules"

    layers: list[str] = field(default_factory=list)
    """Globs over linear-layer FQNs (``layers.*.attention.*``, ``layers.0.*``, ``lm_head``). With first_n and
    last_n all empty the rule selects every layer. The attention products (``layers.*.attention.qk`` /
    ``.pv``) are reached only by a glob that matches no linear layer (``plan.attention``)."""
    first_n: Annotated[int, AtLeast(0)] = 0
    """Also select every linear of the first N transformer blocks (``layers.0`` .. ``layers.N-1``)."""
    last_n: Annotated[int, AtLeast(0)] = 0
    """Also select every linear of the last N transformer blocks."""
    roles: list[str] = field(default_factory=lambda: ["*"])
    """Globs over roles: ``forward.input``, ``forward.weight``, ``dgrad.grad_output``, ``dgrad.weight``,
    ``wgrad.grad_output``, ``wgrad.input``; e.g. ``wgrad.*``, ``*.weight``, ``*``."""
    format: str | None = None
    """Element format (``e4m3``, ``e2m1``, ``int8``, ...) or ``"high"`` for high precision. Unset: keep the
    current format and change only the fields given below."""
    scaling: Scaling | None = None
    """QuantSpec.scaling: none | tensor | axis | block | tile (the axis is the GEMM's contraction dim)."""
    block_size: Annotated[int | None, AtLeast(1)] = None
    """QuantSpec.block_size (block length / tile side)."""
    scale_format: ScaleFormat | None = None
    """QuantSpec.scale_format: fp32 | bf16 | e8m0 | ue4m3."""
    scale_rounding: ScaleRounding | None = None
    """QuantSpec.scale_rounding: exact | floor | ceil | rceil."""
    rounding: RoundingMode | None = None
    """QuantSpec.rounding: nearest | stochastic | toward_zero."""
    saturate: bool | None = None
    """QuantSpec.saturate."""
    margin: int | None = None
    """QuantSpec.margin (power-of-two headroom)."""
    tensor_scale: bool | None = None
    """QuantSpec.tensor_scale (two-level scaling, NVFP4)."""
    scale_min: ScaleMin | None = None
    """QuantSpec.scale_min: subnormal | normal (smallest scale kept; "normal" is torchao's NVFP4 floor)."""
    inf_amax: InfAmax | None = None
    """QuantSpec.inf_amax: keep | nan (a group with an infinite amax; "nan" is torchao's fp8 behaviour)."""
    four_over_six: FourOverSix | None = None
    """QuantSpec.four_over_six: off | mse | mae (NVFP4 4over6 adaptive block scaling; e2m1 blocks/tiles)."""
    scale_apply: ScaleApply | None = None
    """QuantSpec.scale_apply: divide (x / scale) | reciprocal (x * fl(1 / scale), as Transformer Engine's
    quantizers: exact grid midpoints may round the other way)."""
    scale_underflow: ScaleUnderflow | None = None
    """QuantSpec.scale_underflow: clamp (the smallest scale; values kept) | zero (a group whose scale rounds to
    0 becomes 0, as Transformer Engine's NVFP4 quantizer leaves it; needs scale_rounding = "exact")."""
    scale_order: ScaleOrder | None = None
    """QuantSpec.scale_order: decode (tensor scale fl(amax / 2688), ours) | te (Transformer Engine's NVFP4
    arithmetic from the encode scale fl(2688 / amax); needs tensor_scale, exact scales, scale_apply =
    "reciprocal", no 4over6) | torchao (torchao's NVFP4 training kernels: te's but the block scale
    fl(fl(amax_b / 6) x e), signs kept)."""
    amax_history: Annotated[int | None, AtLeast(0)] = None
    """QuantSpec.amax_history: 0 (current scaling) or N > 0 (delayed scaling from the last N amaxes; tensor)."""
    amax_compute: AmaxCompute | None = None
    """QuantSpec.amax_compute: max | most_recent (delayed scaling: the amax taken from the history)."""
    rht: Annotated[int | None, AtLeast(0)] = None
    """QuantSpec.rht: 0 or the size of a random Hadamard transform along the GEMM's contraction dim (set it on
    both operands of a GEMM, e.g. roles = ["wgrad.*"])."""
    rht_seed: Annotated[int | None, AtLeast(0)] = None
    """QuantSpec.rht_seed: seed of the RHT's sign vector."""
    rht_signs: RhtSigns | None = None
    """QuantSpec.rht_signs: seeded (from rht_seed) | te (Transformer Engine's fixed 16-long NVFP4 vector;
    needs rht = 16). Set it on both operands of the GEMM, as rht."""
    rht_output: RhtOutput | None = None
    """QuantSpec.rht_output: fp32 | bf16 (the RHT's result rounded to bf16 before the cast, as torchao's NVFP4
    training kernels; set it on both operands of the GEMM, as rht)."""
    source: Source | None = None
    """QuantSpec.source: high | forward (dgrad.weight / wgrad.input cast from the forward GEMM's cast)."""


def _check_rule_fields() -> None:
    # A QuantSpec field QuantRule lacks could not be set by any rule (plan.resolve sets what both declare).
    have = shared_spec_fields(QuantRule)
    if have != RULE_SPEC_FIELDS:
        missing = [n for n in RULE_SPEC_FIELDS if n not in have]
        extra = [n for n in have if n not in RULE_SPEC_FIELDS]
        raise TypeError(
            f"QuantRule must declare every QuantSpec field but {', '.join(RULE_UNSET_SPEC_FIELDS)} "
            f"(as `name: <QuantSpec's type> | None = None` with a docstring); missing: {missing}, "
            f"not settable by a rule: {extra}"
        )


_check_rule_fields()


@dataclass(kw_only=True, slots=True)
class PlanChange(Section):
    """``[quantize.eval]`` and the body of each ``[[quantize.phases]]`` entry: the ``[quantize]`` plan with
    the keys given here replaced; a key left out keeps the base's (plan/schedule.py resolves it)."""

    SECTION: ClassVar[str] = "quantize.eval"

    recipe: RecipeName | None = None
    """The recipe of this plan (unset: ``[quantize] recipe``)."""
    rules: list[QuantRule] | None = None
    """Rules replacing ``[[quantize.rules]]`` in this plan (unset: the base's rules)."""
    skip: list[str] | None = None
    """Layers kept in high precision, replacing ``[quantize] skip`` in this plan (unset: the base's)."""


@dataclass(kw_only=True, slots=True)
class Phase(PlanChange):
    """``[[quantize.phases]]``: from ``start`` on, training uses this plan (until the next phase)."""

    SECTION: ClassVar[str] = "quantize.phases"

    start: int | float = -1
    """Where the phase begins: an int counts the steps before it (900: from step 901 on), a float in [0, 1)
    is a fraction of ``training.steps`` (0.9 of 1000 steps: from step 901 on)."""


@dataclass(kw_only=True, slots=True)
class QuantizeConfig(Section):
    """``[quantize]``: which number format each GEMM operand of each linear layer uses.

    A ``Section``: every field, those of its rules, phases, eval plan and comm tables included, is checked
    when it is built; ``resolve_plan`` checks what needs the model's layers and the hardware.
    """

    SECTION: ClassVar[str] = "quantize"

    recipe: RecipeName = "bf16"
    """Named recipe for every layer (the names of ``nn.recipes.RECIPES``; bf16: no quantization). What each
    computes: docs/precision_plan.md."""
    backend: Annotated[BackendSetting, Retired("real", REAL_RETIRED)] = "auto"
    """auto (torchao's module with its hardware kernel for every layer whose plan torchao has and whose
    device has the kernel, our emulation for the rest), torchao (torchao's module for every layer whose plan
    it has: its kernel where the device has one, else torchao's emulated mode), emulate (our fake-quantize +
    fp32 matmul everywhere). See docs/precision_plan.md."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """FQN globs of layers kept entirely in high precision (applied after the rules). Default: the output
    projection, as torchao and Transformer Engine do."""
    rules: list[QuantRule] = field(default_factory=list)
    """Overrides applied after the recipe, in order."""
    torchao: TorchaoOptions = field(default_factory=TorchaoOptions)
    """torchao's own options for the layers the torchao backend runs (fp8 all-gather, cast kernels, ...)."""
    phases: list[Phase] = field(default_factory=list)
    """Precision schedule: plans that take over from a step on, in order (plan/schedule.py)."""
    eval: PlanChange = field(default_factory=PlanChange)
    """``[quantize.eval]``: the plan of evaluation (torchtitan's validator); empty: the training plan of the
    step it runs after."""
    comm: CommConfig = field(default_factory=CommConfig)
    """``[quantize.comm]``: low-bit FSDP2 weight all-gather and gradient reduce-scatter (config/comm.py)."""
    saved: list[SavedRule] = field(default_factory=list)
    """``[[quantize.saved]]``: the format of what chosen modules save for the backward (config/saved.py)."""
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)
    """``[quantize.autopilot]``: promote a failing role of a layer up a ladder during the run
    (config/autopilot.py)."""
