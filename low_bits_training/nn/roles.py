"""The per-layer cast plan over the six GEMM operands of a linear layer (``LinearPlan``), and the rules its
specs obey together: which casts a backward role may read or reuse, what an RHT and the ``_scaled_mm``
reference need. The operand table itself (``ROLES``: each GEMM's operands and contraction axes) is
``nn.operands``; it is re-exported here, where callers have always read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from low_bits_training.formats import QuantSpec

from .operands import GEMMS, ROLE_NAMES, ROLES, Gemm, Role
from .recipes import recipe_specs

Backend = Literal["emulate", "real", "torchao", "torchao_emulated", "torchtitan"]
"""Who runs a GEMM: our emulation, our ``_scaled_mm`` reference (``nn.kernels``, not offered in TOML),
torchao's module with its kernel or in its emulated mode, or a module torchtitan's own converter made."""


FORWARD_SOURCES: dict[str, str] = {"dgrad.weight": "forward.weight", "wgrad.input": "forward.input"}
"""Roles that may be cast from the forward GEMM's cast of their tensor (``QuantSpec.source = "forward"``),
and that cast's role."""


REUSABLE: dict[str, str] = {"wgrad.input": "forward.input", "wgrad.grad_output": "dgrad.grad_output"}
"""Backward roles whose cast may be an earlier GEMM's cast of the same tensor (``LinearPlan.reused_casts``),
and that earlier role. The weight's (``dgrad.weight`` from ``forward.weight``) is not among them: keeping a
weight cast from forward to backward would hold every layer's full (all-gathered) weight between them, where
FSDP2 frees it after the forward."""


def same_cast(later: QuantSpec | None, earlier: QuantSpec | None) -> bool:
    """True when two roles of the same tensor cast it to the same values, so the later may reuse the earlier
    cast: equal specs whose scale does not depend on the contraction dim (scaling "tensor" or "none"), with
    deterministic rounding (stochastic rounding draws per role), no RHT (it runs along the contraction dim),
    read from the high-precision tensor. Delayed scaling qualifies: the two roles' histories record the
    same tensor's amax at the same points (a reuse records it into the later role's history too,
    ``nn.gemm.run_gemm``), so they hold the same entries and give the same scale."""
    return (
        later is not None
        and later == earlier
        and later.scaling in ("tensor", "none")
        and later.rounding != "stochastic"
        and not later.rht
        and later.source == "high"
    )


def source_key(role: Role, spec: QuantSpec | None) -> str:
    """Which tensor a role's cast reads: its natural operand, or the forward cast (a role name; the GEMMs
    keep every cast they make under its role's name)."""
    if spec is not None and spec.source == "forward":
        return FORWARD_SOURCES[role.name]
    return role.operand


def operand_problem(specs: tuple[QuantSpec | None, ...], backends: tuple[str, ...]) -> str | None:
    """Why a layer's role specs cannot run together (None: they can). The one check ``LinearPlan`` and the
    TOML plan (``plan.resolve``) share.

    - ``source = "forward"`` only where a forward cast of the same tensor exists (``FORWARD_SOURCES``), and not
      from a forward cast made after an RHT (that copy lives in the rotated basis);
    - an RHT must be the same (size and seed) on both operands of a GEMM, or it does not cancel;
    - the ``_scaled_mm`` reference ("real") casts from the high-precision tensor with current scaling.
    """
    by = dict(zip(ROLE_NAMES, specs, strict=True))
    for name, spec in by.items():
        if spec is None or spec.source == "high":
            continue
        if name not in FORWARD_SOURCES:
            return f"{name}: source = 'forward' is for {' and '.join(FORWARD_SOURCES)} only"
        fwd = by[FORWARD_SOURCES[name]]
        if fwd is not None and fwd.rht:
            return f"{name}: source = 'forward' reads {FORWARD_SOURCES[name]}, which has an RHT (rht = {fwd.rht})"
    for gemm, backend in zip(GEMMS, backends, strict=True):
        a, b = (by[r.name] for r in ROLES if r.gemm == gemm)
        ta, tb = (s.rht_key if s is not None else (0, 0, "seeded") for s in (a, b))
        if ta != tb:
            return (
                f"{gemm}: the RHT (rht, rht_seed, rht_signs) of its operands differ, {ta} vs {tb}; it cancels "
                "in the product only when both operands carry the same one"
            )
        if backend == "real" and any(
            s is not None and (s.amax_history or s.source != "high") for s in (a, b)
        ):
            return f"{gemm}: the 'real' (_scaled_mm) backend casts with current scaling from the high-precision tensor"
    return None


def along_contraction(spec: QuantSpec | None, role: Role) -> QuantSpec | None:
    """``spec`` with its axis set to ``role``'s contraction dim (axis/block scaling; no-op otherwise)."""
    if spec is None or spec.scaling not in ("axis", "block"):
        return spec
    return dataclasses.replace(spec, axis=role.axis)


@dataclass(frozen=True)
class LinearPlan:
    """How one linear layer casts the operands of its three GEMMs.

    ``specs[i]`` belongs to ``ROLES[i]``; None keeps that operand in high precision. Specs are stored with
    their axis already set to the role's contraction dim.
    """

    specs: tuple[QuantSpec | None, ...] = (None,) * len(ROLES)
    """One spec (or None) per role, in ``ROLES`` order."""
    backends: tuple[Backend, ...] = ("emulate",) * len(GEMMS)
    """Per GEMM (``GEMMS`` order), see ``Backend``. Only "emulate" and "real" run inside ``QuantMatmul``; the
    others name layers handed to another module (``plan.backends.gemm_backend`` decides)."""

    def __post_init__(self) -> None:
        if len(self.specs) != len(ROLES) or len(self.backends) != len(GEMMS):
            raise ValueError(f"LinearPlan needs {len(ROLES)} specs and {len(GEMMS)} backends")
        fixed = tuple(along_contraction(s, r) for s, r in zip(self.specs, ROLES, strict=True))
        object.__setattr__(self, "specs", fixed)
        problem = operand_problem(self.specs, self.backends)
        if problem:
            raise ValueError(f"LinearPlan: {problem}")

    @classmethod
    def from_roles(cls, specs: dict[str, QuantSpec | None], backend: Backend = "emulate") -> LinearPlan:
        """A plan from ``{"forward.input": spec, ...}``; missing roles stay high precision.

        Raises:
            ValueError: an unknown role name.
        """
        unknown = sorted(set(specs) - set(ROLE_NAMES))
        if unknown:
            raise ValueError(f"unknown role {unknown[0]!r}: allowed {', '.join(ROLE_NAMES)}")
        return cls(tuple(specs.get(n) for n in ROLE_NAMES), (backend,) * len(GEMMS))

    @classmethod
    def from_recipe(cls, name: str, backend: Backend = "emulate") -> LinearPlan:
        """The plan of a named recipe (``nn.recipes.RECIPES``: "mxfp8", "nvfp4", ...), as ``[quantize] recipe``
        gives every layer it covers (no rules, no block-size check against a layer's shape).

        Raises:
            ConfigError: an unknown recipe name (a ``ValueError``; the message lists the names).
        """
        return cls.from_roles(recipe_specs(name, "recipe"), backend)

    def spec(self, role: str) -> QuantSpec | None:
        """The spec of a role named ``"gemm.operand"``."""
        return self.specs[ROLE_NAMES.index(role)]

    def backend(self, gemm: str) -> Backend:
        return self.backends[GEMMS.index(gemm)]

    @property
    def is_high_precision(self) -> bool:
        return all(s is None for s in self.specs)

    @property
    def reused_casts(self) -> dict[str, str]:
        """Backward roles that reuse an earlier role's cast of the same tensor instead of casting it again
        (``REUSABLE`` where ``same_cast``; emulated GEMMs only), mapped to that role: fp8 tensorwise and
        delayed scaling cast x and dY once each (as Transformer Engine does; torchao casts dY once)."""
        if any(b != "emulate" for b in self.backends):
            return {}
        return {a: b for a, b in REUSABLE.items() if same_cast(self.spec(a), self.spec(b))}

    @property
    def saved_casts(self) -> tuple[str, ...]:
        """Forward casts a backward GEMM reads (``source = "forward"``): kept from forward to backward."""
        return tuple(
            FORWARD_SOURCES[r.name]
            for r, s in zip(ROLES, self.specs, strict=True)
            if s and s.source == "forward"
        )


__all__ = [
    "FORWARD_SOURCES",
    "GEMMS",
    "REUSABLE",
    "ROLES",
    "ROLE_NAMES",
    "Backend",
    "Gemm",
    "LinearPlan",
    "Role",
    "along_contraction",
    "operand_problem",
    "same_cast",
    "source_key",
]
