"""[quantize.autopilot]: the ladder a role climbs, the section's one-line refusals, and the decisions of the
trainer's autopilot on a schedule of real LinearPlans (no model: fake layers that hold a plan)."""

from __future__ import annotations

import json

import pytest

from low_bits_training.config.autopilot import AUTOPILOT_FILE, AutopilotConfig
from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.config.tree import build_dataclass
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec
from low_bits_training.nn import LinearPlan
from low_bits_training.nn.state import QuantState
from low_bits_training.numerics import NonFinite
from low_bits_training.plan.ladder import parse_ladder, promote
from low_bits_training.plan.resolve import LayerShape, resolve_plan
from low_bits_training.plan.schedule import resolve_schedule
from low_bits_training.titan.runtime.autopilot import Autopilot
from low_bits_training.titan.runtime.autopilot.decisions import robust_z
from low_bits_training.titan.runtime.autopilot.replay import Replayable
from low_bits_training.titan.runtime.autopilot.snapshot import Snapshot, Snapshots
from low_bits_training.titan.targets.schedule import PrecisionSchedule

NVFP4 = LinearPlan.from_recipe("nvfp4")
MXFP8 = LinearPlan.from_recipe("mxfp8")


@pytest.mark.parametrize("role", ["forward.input", "dgrad.weight", "wgrad.input"])
def test_a_recipe_ladder_gives_the_role_the_next_recipes_spec(role):
    first = promote(NVFP4.spec(role), role, parse_ladder(["nvfp4", "mxfp8", "high"]))
    assert first == (MXFP8.spec(role), "mxfp8")  # with the role's own axis (wgrad: the token dim)
    assert promote(first[0], role, parse_ladder(["nvfp4", "mxfp8", "high"])) == (None, "high")


def test_a_format_ladder_swaps_the_element_format_only():
    spec = NVFP4.spec("forward.input")
    new, rung = promote(spec, "forward.input", parse_ladder(["e2m1", "e4m3", "high"]))
    assert rung == "e4m3" and new.format == "e4m3"
    assert (new.scaling, new.block_size, new.scale_format) == ("block", 16, "ue4m3")


def test_a_spec_on_no_rung_goes_to_the_top_and_the_top_goes_nowhere():
    spec = QuantSpec("e5m2", "none")
    assert promote(spec, "dgrad.grad_output", parse_ladder(["e2m1", "e4m3", "bf16"])) == (None, "bf16")
    assert promote(spec, "dgrad.grad_output", parse_ladder(["e2m1", "e5m2"])) is None  # on the top rung
    assert promote(None, "dgrad.grad_output", parse_ladder(["high"])) is None  # already high


def test_the_default_ladder_sends_a_role_to_high_precision():
    assert AutopilotConfig().ladder == ["high"]
    assert promote(NVFP4.spec("forward.weight"), "forward.weight", parse_ladder(["high"])) == (None, "high")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ladder": ["e4m3", "fp9"]}, "quantize.autopilot.ladder[1] = 'fp9': expected 'high', a recipe ("),
        ({"ladder": []}, "quantize.autopilot.ladder = []: expected at least one rung"),
        ({"ladder": ["e4m3", "e4m3"]}, "quantize.autopilot.ladder = ['e4m3', 'e4m3']: a rung appears twice"),
        ({"saturation": 2.0}, "quantize.autopilot.saturation = 2.0: expected a share in [0, 1]"),
        ({"underflow": -0.1}, "quantize.autopilot.underflow = -0.1: expected a number >= 0.0 (0: off)"),
        ({"every": 0}, "quantize.autopilot.every = 0: expected an int >= 1"),
    ],
)
def test_bad_autopilot_keys_are_one_line_naming_the_key(fields, message):
    with pytest.raises(ConfigError) as e:
        build_dataclass(QuantizeConfig, {"autopilot": fields}, "quantize")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


class _Layer(QuantState):
    def __init__(self, plan):
        self.plan = plan


class _Padded(_Layer):
    """A target that, as built, runs no block along the tokens (an expert weight whose dispatcher pads to 1)."""

    def check_plan(self, plan):
        if any(s is not None and s.scaling == "block" for s in plan.specs):
            raise ValueError("needs padding")


def _pilot(tmp_path, rules, start=1, **cfg):
    """An autopilot over two layers whose plans come from ``rules`` on the bf16 recipe, at step ``start`` (a
    later one: a resumed run, which replays the decisions in ``tmp_path`` before it)."""
    shapes = {f"layers.{i}.w": LayerShape(256, 256, 256) for i in range(2)}
    quantize = QuantizeConfig(recipe="bf16", skip=[], rules=rules)
    plans = resolve_plan(quantize, shapes)
    schedule = resolve_schedule(quantize, shapes, steps=100)
    layers = [(f, _Layer(plans[f])) for f in shapes]
    sched = PrecisionSchedule(schedule, layers)
    sched.begin_step(start)
    pilot = Autopilot(AutopilotConfig(enable=True, **cfg), sched, str(tmp_path))
    pilot.begin_step(start)
    return pilot, dict(layers)


E2M5_INPUT = QuantRule(
    layers=["layers.1.w"], roles=["forward.input"], format="e2m5", scaling="none", saturate=False
)


def test_a_nonfinite_product_promotes_its_unsaturated_operand_and_asks_for_the_step_again(tmp_path):
    rule = QuantRule(layers=["layers.1.w"], roles=["forward.weight"], format="e4m3")
    pilot, layers = _pilot(tmp_path, [E2M5_INPUT, rule], ladder=["e2m5", "e4m3", "high"])
    event = NonFinite(3, "layers.1.w", "forward.output", 0)
    assert pilot.on_nonfinite(event)
    plan = layers["layers.1.w"].plan
    assert plan.spec("forward.input").short() == "e4m3/none/rne/nosat"  # the unsaturated operand only
    assert plan.spec("forward.weight").short().startswith("e4m3/tensor")  # saturating: left alone
    (row,) = [json.loads(x) for x in (tmp_path / AUTOPILOT_FILE).read_text().splitlines()]
    assert row == {
        "step": 3,
        "layer": "layers.1.w",
        "role": "forward.input",
        "trigger": "nonfinite",
        "value": "forward.output",
        "before": "e2m5/none/rne/nosat",
        "after": "e4m3/none/rne/nosat",
        "rung": "e4m3",
        "seen": 0,
    }
    assert pilot.metrics() == {"autopilot/promotions": 1.0} and pilot.metrics() == {}
    # A non-finite operand came from upstream, and a high-precision layer has nothing to promote.
    assert not pilot.on_nonfinite(NonFinite(3, "layers.1.w", "forward.input", 0))
    assert not pilot.on_nonfinite(NonFinite(3, "layers.0.w", "forward.output", 0))


def test_redos_of_a_step_are_capped(tmp_path):
    pilot, _ = _pilot(tmp_path, [E2M5_INPUT], ladder=["e2m5", "e3m4", "e4m3", "high"], max_redos=2)
    event = NonFinite(1, "layers.1.w", "forward.output", 0)
    assert pilot.on_nonfinite(event)
    pilot.begin_step(1)  # the trainer runs step 1 again
    assert pilot.on_nonfinite(event)
    pilot.begin_step(1)
    assert not pilot.on_nonfinite(event)  # the third time in one step goes to numerics.nonfinite's policy
    pilot.begin_step(2)
    assert pilot.on_nonfinite(event)  # e4m3 -> high: a new step may redo again


def test_statistics_over_a_threshold_promote_on_statistics_steps_only(tmp_path):
    grads = QuantRule(roles=["*.grad_output"], format="e5m2", scaling="none")
    pilot, layers = _pilot(tmp_path, [grads], every=10)
    row = {"layer": "layers.0.w", "role": "dgrad.grad_output", "clipping": 0.0, "sqnr_db": 20.0}
    pilot.on_stats(7, [dict(row, underflow=0.9)])  # not a statistics step (1, 10, 20, ...)
    assert layers["layers.0.w"].plan.spec("dgrad.grad_output") is not None
    pilot.on_stats(10, [dict(row, underflow=0.4), dict(row, layer="layers.1.w", underflow=0.9)])
    assert layers["layers.0.w"].plan.spec("dgrad.grad_output") is not None  # 0.4 <= 0.5
    assert layers["layers.1.w"].plan.spec("dgrad.grad_output") is None
    assert layers["layers.1.w"].plan.spec("wgrad.grad_output") is not None  # only the role that failed
    assert [d.trigger for d in pilot.decisions] == ["underflow"]


def test_the_saturation_trigger_reads_clipping_not_values_a_rounded_block_scale_lifts(tmp_path):
    """NVFP4 on ordinary data: ~3.5% of values sit just above 6 after the ue4m3 block scale rounds down
    (``saturation``), none clipped past the rounding boundary (``clipping``): no promotion. A role that
    clips 2% is promoted under the default threshold (1%)."""
    grads = QuantRule(roles=["*.grad_output"], format="e5m2", scaling="none")
    pilot, layers = _pilot(tmp_path, [grads])
    row = {"layer": "layers.0.w", "role": "dgrad.grad_output", "underflow": 0.0, "sqnr_db": 20.0}
    pilot.on_stats(1, [dict(row, saturation=0.035, clipping=0.0)])
    assert not pilot.decisions and layers["layers.0.w"].plan.spec("dgrad.grad_output") is not None
    pilot.on_stats(10, [dict(row, saturation=0.035, clipping=0.02)])
    assert [(d.trigger, d.value) for d in pilot.decisions] == [("saturation", 0.02)]


def test_a_resumed_run_replays_the_decisions_before_its_first_step(tmp_path):
    grads = QuantRule(roles=["*.grad_output"], format="e5m2", scaling="none")
    first, _ = _pilot(tmp_path, [grads])
    row = {"role": "dgrad.grad_output", "clipping": 0.0, "sqnr_db": 20.0, "underflow": 0.9}
    first.on_stats(10, [dict(row, layer="layers.0.w")])
    first.on_stats(20, [dict(row, layer="layers.1.w")])
    # A resume from step 15's checkpoint: step 10's decision is replayed, step 20's (redone) is dropped.
    _, got = _pilot(tmp_path, [grads], start=16)
    assert got["layers.0.w"].plan.spec("dgrad.grad_output") is None
    assert got["layers.1.w"].plan.spec("dgrad.grad_output") is not None
    assert [json.loads(x)["step"] for x in (tmp_path / AUTOPILOT_FILE).read_text().splitlines()] == [10]


def test_promoted_plans_are_one_object_per_distinct_plan_and_outlive_phase_changes(tmp_path):
    pilot, layers = _pilot(tmp_path, [E2M5_INPUT], ladder=["e2m5", "e4m3", "high"])
    pilot.on_nonfinite(NonFinite(1, "layers.1.w", "forward.output", 0))
    sched, before = pilot.schedule, layers["layers.1.w"].plan
    sched._apply(sched.current.plans)  # what a phase change or the end of evaluation does
    assert layers["layers.1.w"].plan is before  # the same object: a compiled graph's guard holds


def test_replayable_hands_the_same_batches_again_then_goes_on():
    it = Replayable(iter(range(5)))
    assert [next(it), next(it)] == [0, 1]
    it.rewind()
    assert [next(it), next(it), next(it)] == [0, 1, 2]


def test_robust_z_reads_the_median_and_the_median_absolute_deviation():
    history = [1.0, 2.0, 3.0, 4.0, 100.0]  # median 3, deviations 2 1 0 1 97: MAD 1
    assert robust_z(history, 3.0 + 1.4826 * 6) == pytest.approx(6.0)
    assert robust_z(history, 2.0) < 0  # below the median: no spike
    assert robust_z([5.0] * 8, 5.0 + 5e-3 * 6) == pytest.approx(6.0)  # flat: the 1e-3 x median floor


def test_a_spike_needs_a_full_window_a_robust_z_and_a_rise(tmp_path):
    pilot, _ = _pilot(tmp_path, [], spike_z=6.0, spike_window=8)
    for step in range(1, 9):  # up to 7 earlier steps: the window (8) is not full, nothing is judged
        assert pilot.spike(step, 5.0 - 0.01 * step if step < 8 else 50.0, 1.0) is None
    assert pilot.spike(9, 5.0, 1.0) is None  # 8 earlier steps, one of them the outlier: robust
    assert pilot.spike(10, 5.0, 1.9) is None  # z in the thousands (a flat window), but under 2x the median
    what, z = pilot.spike(11, 5.0, 9.0)
    assert what == "grad_norm" and z > 6
    assert pilot.spike(12, 6.1, 1.0) is None  # 6.1 < 1.25 x the median loss (4.96)
    what, z = pilot.spike(13, 6.5, 1.0)
    assert what == "loss" and z > 6
    off, _ = _pilot(tmp_path / "off", [], spike_z=0.0)
    assert off.snapshots is None and all(off.spike(s, 1e9 * s, 1.0) is None for s in range(1, 20))


def _snap(step: int) -> Snapshot:
    return Snapshot(step, [], [], [], {"step": step, "ntokens_seen": 0})


def test_snapshots_are_taken_every_n_steps_and_at_checkpoints_and_the_two_newest_are_kept():
    snaps = Snapshots(every=4, checkpoint_every=6, max_bytes=2**30)
    assert [s for s in range(1, 14) if snaps.due(s, first=s == 1)] == [1, 5, 7, 9, 13]
    for step in (0, 4, 6):
        snaps.add(_snap(step))
        for k in range(step + 1, step + 3):
            snaps.record(k, [f"batch {k}"])
    assert [s.step for s in snaps.kept] == [4, 6]
    assert sorted(snaps.batches) == [5, 6, 7, 8]  # since the oldest kept
    assert snaps.target(8).step == 6 and snaps.target(7).step == 4  # undo at least one update
    snaps.back_to(4)
    assert [s.step for s in snaps.kept] == [4]


def test_a_spike_rolls_back_and_promotes_the_role_the_last_statistics_found_worst(tmp_path):
    grads = QuantRule(roles=["*.grad_output", "forward.input"], format="e4m3", scaling="tensor")
    pilot, layers = _pilot(tmp_path, [grads], spike_z=6.0, spike_window=8, saturation=0.0, underflow=0.0)
    row = {"clipping": 0.0, "underflow": 0.1, "sqnr_db": 30.0}
    pilot.on_stats(1, [
        dict(row, layer="layers.0.w", role="forward.input", clipping=0.002),
        dict(row, layer="layers.1.w", role="forward.input", clipping=0.004),
        dict(row, layer="layers.1.w", role="dgrad.grad_output", underflow=0.3),
    ])  # fmt: skip
    pilot.snapshots.add(_snap(4))
    pilot.snapshots.add(_snap(8))
    for step in range(1, 10):
        assert pilot.after_step(None, step, (step, 5.0, 1.0)) is None
    back = pilot.after_step(None, 10, (10, 40.0, 1.0))
    assert back.step == 8
    assert layers["layers.1.w"].plan.spec("forward.input") is None  # the most clipped role: up to high
    assert layers["layers.0.w"].plan.spec("forward.input") is not None
    (d,) = pilot.decisions
    assert (d.step, d.seen, d.layer, d.role, d.trigger) == (
        9,
        10,
        "layers.1.w",
        "forward.input",
        "loss_spike",
    )
    assert "spike at step 10: rolled back to step 8" in d.message()
    assert pilot.metrics() == {"autopilot/promotions": 1.0, "autopilot/rollbacks": 1.0}
    assert sorted(pilot.history) == list(range(1, 9))  # the abandoned steps' figures are gone


def test_a_spike_without_a_snapshot_or_past_the_cap_is_only_logged(tmp_path):
    pilot, _ = _pilot(tmp_path, [], spike_z=6.0, spike_window=8, on_spike="rollback", max_rollbacks=1)
    for step in range(1, 10):
        pilot.after_step(None, step, (step, 5.0, 1.0))
    assert pilot.after_step(None, 10, (10, 40.0, 1.0)) is None  # no snapshot yet
    pilot.snapshots.add(_snap(9))
    back = pilot.after_step(None, 11, (11, 40.0, 1.0))
    assert back.step == 9 and pilot.decisions[-1].layer == ""  # the same plan again
    assert pilot.after_step(None, 12, (12, 40.0, 1.0)) is None  # max_rollbacks = 1
    assert pilot.after_step(None, 13, (12, 40.0, 1.0)) is None  # a step that logged nothing


def test_a_promoted_role_is_tried_one_rung_down_after_clean_steps_and_waits_twice_as_long_after(tmp_path):
    pilot, layers = _pilot(tmp_path, [E2M5_INPUT], ladder=["e2m5", "e4m3", "high"], demote_after=5)
    layer = layers["layers.1.w"]
    assert pilot.on_nonfinite(NonFinite(3, "layers.1.w", "forward.output", 0))  # e2m5 -> e4m3 at step 3
    for step in range(4, 8):
        pilot.begin_step(step)
        assert layer.plan.spec("forward.input").format == "e4m3"
    pilot.begin_step(8)  # 5 steps since step 3: back down
    assert layer.plan.spec("forward.input").short() == "e2m5/none/rne/nosat"
    d = pilot.decisions[-1]
    assert (d.step, d.trigger, d.value, d.before, d.after, d.rung) == (
        8,
        "clean",
        5.0,
        "e4m3/none/rne/nosat",
        "e2m5/none/rne/nosat",
        "down",
    )
    assert pilot.metrics() == {"autopilot/promotions": 1.0, "autopilot/demotions": 1.0}
    pilot.begin_step(9)
    assert pilot.on_nonfinite(NonFinite(9, "layers.1.w", "forward.output", 0))  # fails again: up again
    for step in range(10, 19):
        pilot.begin_step(step)  # the wait is now 10 steps
    assert layer.plan.spec("forward.input").format == "e4m3"
    pilot.begin_step(19)
    assert layer.plan.spec("forward.input").format == "e2m5"
    # A resume at step 12 replays the decisions before it: up, down, up; the next demotion waits 10 as well.
    again, again_layers = _pilot(
        tmp_path, [E2M5_INPUT], start=12, ladder=["e2m5", "e4m3", "high"], demote_after=5
    )
    got = again_layers["layers.1.w"]
    assert got.plan.spec("forward.input").format == "e4m3"
    for step in range(13, 19):
        again.begin_step(step)
    assert got.plan.spec("forward.input").format == "e4m3"
    again.begin_step(19)
    assert got.plan.spec("forward.input").format == "e2m5"


def test_a_spike_that_comes_back_after_a_replay_under_the_same_plan_is_kept(tmp_path):
    """A replay under the same plan with the same batches is deterministic: a spike it meets again is the
    run's own, not a transient fault, and a second rollback would only repeat it."""
    pilot, _ = _pilot(tmp_path, [], spike_z=6.0, spike_window=8, on_spike="rollback")
    for step in range(1, 10):
        pilot.after_step(None, step, (step, 5.0, 1.0))
    pilot.snapshots.add(_snap(9))
    assert pilot.after_step(None, 11, (11, 40.0, 1.0)).step == 9
    assert pilot.after_step(None, 10, (10, 5.0, 1.0)) is None  # the replay
    assert pilot.after_step(None, 11, (11, 40.0, 1.0)) is None  # the same spike again: kept
    assert pilot.rollbacks == 1


def test_a_rung_the_target_cannot_run_is_not_taken(tmp_path):
    """``QuantState.check_plan`` refuses the promoted plan: the role keeps its spec, nothing is recorded."""
    pilot, layers = _pilot(tmp_path, [E2M5_INPUT], ladder=["e2m5", "mxfp8", "high"])
    padded = _Padded(layers["layers.1.w"].plan)
    pilot.schedule.layers[1] = ("layers.1.w", padded)
    pilot.layers["layers.1.w"] = padded
    assert not pilot.on_nonfinite(NonFinite(1, "layers.1.w", "forward.output", 0))
    assert padded.plan.spec("forward.input").short() == "e2m5/none/rne/nosat"
    assert pilot.decisions == [] and pilot.schedule.overrides["layers.1.w"] == {}
