"""``[quantize.autopilot]``: promote one role of one layer up a ladder of formats when its numerics fail.

    [quantize.autopilot]
    enable = true
    ladder = ["nvfp4", "mxfp8", "high"]   # rungs: recipe names, element formats, "high"
    saturation = 0.01                     # a role whose share of clipped values passes this is promoted
    underflow = 0.5                       # ... whose share of nonzero values flushed to zero passes this
    sqnr_db = 0.0                         # ... whose SQNR falls under this floor (0: off)
    every = 10                            # statistics (and their triggers) on step 1 and every 10 steps

What fires (``titan/runtime/autopilot/`` acts on it):

- a non-finite value in a quantized layer's GEMM (``nonfinite = true``; needs ``numerics.nonfinite`` on):
  the roles that made it are promoted and the step is run again from its start under the new plan (its
  gradients were never applied), so no non-finite value reaches the weights or the loss curve;
- a statistic over its threshold on a statistics step: that role is promoted from the next step on;
- a spike of the loss or the gradient norm (``spike_z``): the run rolls back in memory to a host snapshot
  a few steps earlier and replays those steps (with the worst role promoted, ``on_spike = "promote"``).

A promotion moves a role one rung up: a recipe rung gives the role that recipe's spec for it, a format
rung keeps the role's scaling, block and rounding and swaps the element format, ``high`` ends
quantization of that role. A role whose spec is on no rung goes to the top rung. Pure config: the plan
and the model come in as values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from low_bits_training.config.section import AtLeast, Section
from low_bits_training.errors import ConfigError
from low_bits_training.formats import HIGH
from low_bits_training.formats.table import get_format
from low_bits_training.nn.recipes import RECIPES

SpikeAction = Literal["promote", "rollback"]
AUTOPILOT_FILE = "autopilot.jsonl"
"""The decisions of a run, one JSON object per line, in the run folder (read back on resume)."""


@dataclass(kw_only=True, slots=True)
class AutopilotConfig(Section):
    """``[quantize.autopilot]``: promote a failing role of a layer up a ladder, during the run."""

    SECTION: ClassVar[str] = "quantize.autopilot"

    enable: bool = False
    """Watch the quantized linear layers' and expert weights' roles and promote the ones that fail (off by
    default)."""
    ladder: list[str] = field(default_factory=lambda: [HIGH])
    """Rungs from low to high: recipe names (``nvfp4``, ``mxfp8``), element formats (``e2m1``, ``e4m3``,
    ``bf16``), ``high``. The default sends a failing role straight to high precision."""
    nonfinite: bool = True
    """Promote the roles of a GEMM that made a NaN / Inf and run the step again under the new plan."""
    saturation: Annotated[float, AtLeast(0.0, "0: off")] = 0.01
    """Promote a role whose share of clipped values (``clipping``: past the format's max by more than half its
    top grid step, ``numerics.stats``) passes this (0: off)."""
    underflow: Annotated[float, AtLeast(0.0, "0: off")] = 0.5
    """Promote a role whose share of nonzero values flushed to zero passes this (0: off)."""
    sqnr_db: Annotated[float, AtLeast(0.0, "0: off")] = 0.0
    """Promote a role whose signal-to-quantization-noise ratio falls under this many dB (0: off)."""
    every: Annotated[int, AtLeast(1)] = 10
    """Statistics steps of the triggers: step 1 and every ``every`` steps (besides ``numerics.stats_freq``)."""
    max_promotions: Annotated[int, AtLeast(1)] = 64
    """Promotions in a run at most; past it a failure goes to ``numerics.nonfinite``'s policy. Under
    torch.compile each promotion may compile one more graph of a block (the recompile limit is raised by it)."""
    max_redos: Annotated[int, AtLeast(0)] = 4
    """Times one step may be run again after a non-finite value (each time with one more promotion)."""
    spike_z: Annotated[float, AtLeast(0.0, "0: off")] = 6.0
    """A logged step whose loss or gradient norm lies this many robust standard deviations (median and
    median absolute deviation of the last ``spike_window`` logged steps) above the median is a spike: the
    run rolls back in memory to a host snapshot and goes on from there (0: off, no snapshots kept)."""
    spike_window: Annotated[int, AtLeast(4)] = 32
    """Logged steps the spike statistic reads; it fires only once the window is full (no spike is judged in
    the first ``spike_window`` logged steps, where the gradient norm moves fast by itself)."""
    spike_loss_rise: Annotated[float, AtLeast(0.0)] = 0.25
    """A loss spike must also lie this share above the window's median (0.25: 25% higher)."""
    spike_grad_rise: Annotated[float, AtLeast(0.0)] = 1.0
    """A gradient-norm spike must also lie this share above the window's median (1.0: twice the median)."""
    on_spike: SpikeAction = "promote"
    """After a rollback: ``promote`` the role that the last statistics step found worst (most clipped,
    then most flushed to zero, then lowest SQNR) and replay the steps under the new plan; ``rollback``
    replays the same plan (a transient fault: a bad node, a corrupted batch)."""
    snapshot_every: Annotated[int, AtLeast(1)] = 10
    """Steps between host snapshots (model, optimizer states in their own formats, scheduler, step). A
    snapshot is also taken at every checkpoint step and at the first step, so a rollback never goes back
    past a checkpoint; the two newest are kept with the batches drawn since the older one."""
    snapshot_gib: Annotated[float, AtLeast(0.0)] = 16.0
    """Host memory the snapshots of one rank may hold, in GiB: a run whose two snapshots need more keeps
    none and says so once (spikes are then logged, not acted on)."""
    max_rollbacks: Annotated[int, AtLeast(0)] = 8
    """Rollbacks in a run at most; past it a spike is only logged."""
    demote_after: Annotated[int, AtLeast(0, "0: never")] = 0
    """Steps a promoted role runs with no new promotion before it is tried one rung down again (the format
    it left); each demotion of a role doubles its next wait, so a role that keeps failing settles up the
    ladder (0: never demote)."""

    def check(self) -> None:
        """Raises: ConfigError (one line) for a field out of range or a rung that names nothing."""
        Section.check(self)
        for k in ("saturation", "underflow"):
            if getattr(self, k) > 1:
                raise ConfigError(
                    f"quantize.autopilot.{k} = {getattr(self, k)!r}: expected a share in [0, 1]"
                )
        if not self.ladder:
            raise ConfigError("quantize.autopilot.ladder = []: expected at least one rung (e.g. ['high'])")
        for i, rung in enumerate(self.ladder):
            rung_kind(rung, f"quantize.autopilot.ladder[{i}]")
        if len(set(self.ladder)) != len(self.ladder):
            raise ConfigError(f"quantize.autopilot.ladder = {self.ladder!r}: a rung appears twice")

    @property
    def stat_triggers(self) -> bool:
        """True when a statistic can promote (saturation, underflow or SQNR on)."""
        return bool(self.saturation or self.underflow or self.sqnr_db)

    @property
    def reads_stats(self) -> bool:
        """True when the autopilot reads statistics steps: a statistic can promote, or a spike promotes the
        role the newest statistics find worst."""
        return self.stat_triggers or bool(self.spike_z and self.on_spike == "promote")


def rung_kind(rung: str, where: str = "quantize.autopilot.ladder") -> str:
    """``"high"``, ``"recipe"`` or ``"format"``.

    Raises:
        ConfigError: the rung is none of them (one line naming what is allowed).
    """
    if rung == HIGH:
        return HIGH
    if rung in RECIPES:
        return "recipe"
    try:
        get_format(rung)
    except (KeyError, ValueError):
        raise ConfigError(
            f"{where} = {rung!r}: expected 'high', a recipe ({', '.join(RECIPES)}) or an element format "
            "(e2m1, e4m3, e5m2, int8, bf16, ...)"
        ) from None
    return "format"
