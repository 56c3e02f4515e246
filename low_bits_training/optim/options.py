"""Typed, validated per-group options of the low-bit optimizers (``optimizer_kwargs`` in the TOML).

Each error is one line naming the key, the value and what is allowed (the titan layer prefixes the TOML path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

from low_bits_training.formats import QuantSpec
from low_bits_training.formats.spec import choice_fields

from .presets import allowed_names, parse_state_format

MasterRounding = Literal["nearest", "stochastic", "kahan"]
IGNORED_GROUP_KEYS = frozenset({"params", "param_names", "foreach", "initial_lr"})
"""Keys torch / torchtitan put into every param group; not options of ours (torchtitan's ``fused`` is)."""


def _check_format(key: str, value: Any, allow_none: bool = False, signed: bool = True) -> QuantSpec | None:
    """The state format of option ``key``; ``signed``: the state has negative values, so the element format
    must hold them (an unsigned codebook such as ``udt8`` would clamp them to 0)."""
    if allow_none and value in (None, "none"):
        return None
    try:
        spec = parse_state_format(value)
    except (ValueError, TypeError) as e:
        allowed = ("'none', " if allow_none else "") + allowed_names()
        raise ValueError(f"{key}={value!r}: {str(e).splitlines()[0]}; allowed {allowed}") from None
    if signed and not spec.elem.signed:
        raise ValueError(
            f"{key}={value!r}: format {spec.format!r} is unsigned and this state is signed; allowed a signed "
            "format (dt8_block256, int8_block128, ...; unsigned ones only for exp_avg_sq)"
        )
    return spec


@dataclass(frozen=True)
class _Common:
    lr: float
    """Learning rate (the LR scheduler scales it)."""
    weight_decay: float = 0.0
    """AdamW: decoupled, w <- w * (1 - lr * weight_decay). SGD: coupled L2, weight_decay * w is added to the
    gradient (torch.optim.SGD's rule)."""
    master_weights: str | dict | None = "none"
    """Format of the weights after each update: "none" (the parameter's own dtype, a plain copy), "bf16",
    or any state format ("e4m3_block128", ...). Values are rounded onto this grid in the parameter tensor."""
    master_rounding: MasterRounding = "nearest"
    """How the updated weights are rounded to ``master_weights``: "nearest", "stochastic" (unbiased), or
    "kahan" (nearest plus a bf16 compensation buffer carrying the rounding error to the next step)."""
    min_quantized_numel: int = 4096
    """Parameters with fewer elements (norm weights, biases) keep fp32 states: tiny, and most sensitive."""
    seed: int = 0
    """Seed of the stochastic-rounding streams (see ``optim.rng``)."""
    fused: bool = True
    """Run each chunk's update as one compiled kernel (torch.compile; the first step compiles, seconds on CPU,
    which needs a C++ compiler). False: the same update run eagerly, op by op, the reference it equals bit for
    bit: slow, several times torch's foreach AdamW (docs/optimizers.md), meant for checks and machines without
    a compiler, not for training. torchtitan sets it from ``[optimizer] implementation`` ("fused", its default: true; "foreach" /
    "for-loop": false) unless ``optimizer_kwargs`` name it."""

    batch_numel: int = 0
    """Fused update: chunks of at most this many elements (norms, biases, small matrices) with the same layout
    are updated several per compiled call (``optim.fused.ChunkBatch``; the same bits as one call each). 0 (the
    default): one call each. Off by default because each distinct batch is one more compile on the first step:
    ``train_configs/debug_lean.toml``, 3 steps from a cold compile cache, took 292 s with 65536 against 123 s
    without on 2 shared cores; later steps run faster (docs/optimizers.md)."""

    in_backward: bool = False
    """Update each parameter of the group in the backward, as soon as its gradient is complete (a
    ``register_post_accumulate_grad_hook``), and free that gradient: the gradients are never all held at once
    (``training.dtype``'s 2-4 bytes per parameter less at the peak). The same update and bits as ``step()``
    (one parameter at a time, its own random stream); ``step()`` then finds no gradients. The gradients must be
    whole after one backward on one rank: no gradient clipping, accumulation, data / tensor / pipeline /
    context parallelism, NaN skipping or autopilot (the launcher refuses them, ``titan/runtime/optim.py``)."""

    def __post_init__(self) -> None:
        for name, allowed in choice_fields(type(self)):
            value = getattr(self, name)
            if name != "master_weights" and all(isinstance(a, str) for a in allowed) and value not in allowed:
                raise ValueError(f"{name}={value!r}: allowed {list(allowed)}")
        for key in ("lr", "weight_decay"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{key}={v!r}: allowed a finite number >= 0")
        for key in ("fused", "in_backward"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}={getattr(self, key)!r}: allowed true, false")
        for key in ("min_quantized_numel", "seed", "batch_numel"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{key}={v!r}: allowed an int >= 0")
        master = _check_format("master_weights", self.master_weights, allow_none=True)
        if master is None and self.master_rounding != "nearest":
            raise ValueError(
                f"master_rounding={self.master_rounding!r}: needs master_weights set (not 'none')"
            )

    @property
    def master_spec(self) -> QuantSpec | None:
        return _check_format("master_weights", self.master_weights, allow_none=True)

    @classmethod
    def from_group(cls, group: dict[str, Any]):
        """Options from a param group dict (torch's and torchtitan's own keys ignored).

        Raises:
            ValueError: unknown key, missing lr, or a bad value (one line).
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(k for k in group if k not in names and k not in IGNORED_GROUP_KEYS)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; allowed {sorted(names)}")
        if "lr" not in group:
            raise ValueError("lr is required")
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in group.items() if k in names}
        return cls(**kw)


@dataclass(frozen=True)
class AdamWOptions(_Common):
    """Options of ``LowBitAdamW``. The update is computed in fp32 from the dequantized states."""

    betas: tuple[float, float] = (0.9, 0.999)
    """(beta1, beta2) of the moment EMAs."""
    eps: float = 1e-8
    """Added to sqrt(v_hat)."""
    exp_avg: str | dict = "int8_block128"
    """Format of the first moment m (signed)."""
    exp_avg_sq: str | dict = "int8_block128"
    """Format of the second moment: stores sqrt(v) when ``sqrt_exp_avg_sq`` (halves its log-range). It is
    never negative, so unsigned formats (``udt8_block256``) serve too. int8 blocks on sqrt(v) by measurement
    (issue 40, docs/optimizers.md): update-direction error 0.0071 against e4m3's 0.0255 and torchao AdamW8bit's
    0.0110, the least probe loss gap of the fast formats, at e4m3's bytes."""
    sqrt_exp_avg_sq: bool = True
    """Store sqrt(v) instead of v: v spans ~2x the binades of m; sqrt(v) has m's units and range."""
    v_floor: bool = True
    """Use max(v, m^2 / C^2) in the update, C = (1-b1) / sqrt((1-b2)(1-b1^2/b2)): exact Adam always has
    |m| <= C sqrt(v) (Cauchy-Schwarz, b1^2 < b2), so this only undoes a v quantized to (near) zero."""

    def __post_init__(self) -> None:
        super().__post_init__()
        b = self.betas
        if not (
            isinstance(b, tuple) and len(b) == 2 and all(isinstance(x, int | float) and 0 <= x < 1 for x in b)
        ):
            raise ValueError(
                f"betas={list(b) if isinstance(b, tuple) else b!r}: allowed two numbers in [0, 1)"
            )
        if isinstance(self.eps, bool) or not isinstance(self.eps, int | float) or not self.eps > 0:
            raise ValueError(f"eps={self.eps!r}: allowed a number > 0")
        _check_format("exp_avg", self.exp_avg)
        _check_format("exp_avg_sq", self.exp_avg_sq, signed=False)
        for key in ("sqrt_exp_avg_sq", "v_floor"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}={getattr(self, key)!r}: allowed true, false")

    def state_specs(self) -> dict[str, QuantSpec]:
        """State name -> format."""
        return {
            "exp_avg": parse_state_format(self.exp_avg),
            "exp_avg_sq": parse_state_format(self.exp_avg_sq),
        }


@dataclass(frozen=True)
class SGDOptions(_Common):
    """Options of ``LowBitSGD`` (momentum SGD, torch.optim.SGD's update, dampening 0)."""

    momentum: float = 0.9
    """Momentum factor (> 0; use torch's SGD for none)."""
    nesterov: bool = False
    """Nesterov momentum."""
    momentum_buffer: str | dict = "int8_block128"
    """Format of the momentum buffer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        m = self.momentum
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 < m < 1:
            raise ValueError(f"momentum={m!r}: allowed a number in (0, 1)")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov={self.nesterov!r}: allowed true, false")
        _check_format("momentum_buffer", self.momentum_buffer)

    def state_specs(self) -> dict[str, QuantSpec]:
        return {"momentum_buffer": parse_state_format(self.momentum_buffer)}
