"""lbt-report from real run folders: two tiny trainings with statistics on, then the files and their numbers."""

from __future__ import annotations

import base64
import json
import math
import re
import subprocess
import sys

import pytest

from helpers import REPO, train, write_toml


def _run(tmp_path, name, recipe):
    cfg = write_toml(tmp_path / f"{name}.toml", quantize={"recipe": recipe}, numerics={"stats_freq": 1})
    (tmp_path / name).mkdir()
    return train(tmp_path / name, "--training.steps", "2", "--checkpoint.no-enable", config=cfg)


def test_report_from_two_real_runs(tmp_path):
    runs = [_run(tmp_path, "mx", "mxfp8"), _run(tmp_path, "int8", "int8")]
    for run in runs:  # statistics reached numerics.jsonl and the metrics loggers
        rows = [json.loads(x) for x in (run.folder / "numerics.jsonl").read_text().splitlines()]
        assert {r["step"] for r in rows} == {1, 2}
        assert len({(r["layer"], r["role"]) for r in rows}) >= 6 * 6 * 5  # 6 blocks x 5 linears x 6 roles
        assert all(0 <= r["underflow"] < 0.3 and 15 < float(r["sqnr_db"]) < 60 for r in rows)
        assert "numerics/forward.input/sqnr_db_min" in run.rows[0]
    # int8 rows (7 bits below amax, no subnormals) flush far more small values than MXFP8 e4m3 (17 binades)
    under = [max(json.loads(x)["underflow"] for x in (r.folder / "numerics.jsonl").open()) for r in runs]
    assert under[1] > 0.05 > under[0]
    out = tmp_path / "report"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "low_bits_training.cli.report",
            *(str(r.folder) for r in runs),
            "-o",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    page = (out / "report.html").read_text()
    names = ["mx_run", "int8_run"]  # both folders are called "run": told apart by their parent
    for png in ["loss.png", "throughput.png", "memory.png"] + [
        f"{n}_{m}.png" for n in names for m in ("underflow", "saturation", "sqnr_db")
    ]:
        assert (out / png).stat().st_size > 10_000, png
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(imgs) == 9 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in imgs)
    table = re.search(r'<table id="numbers">(.*?)</table>', page).group(1)
    cells = re.findall(r"<tr>(.*?)</tr>", table)[1:]
    assert [re.findall(r"<td>(.*?)</td>", c)[0] for c in cells] == names
    for run, cell in zip(runs, cells, strict=True):
        values = re.findall(r"<td>(.*?)</td>", cell)
        assert values[1] == "2/2" and float(values[2]) == pytest.approx(run.losses[2], rel=1e-3)


def test_report_missing_folder_is_one_line(tmp_path):
    from low_bits_training.cli.report import main

    assert main([str(tmp_path / "nope"), "-o", str(tmp_path / "o")]) == 2


def test_whatif_rows_get_their_own_table_and_stay_out_of_the_heatmaps(tmp_path):
    from low_bits_training.report.build import build_report
    from low_bits_training.report.runs import load_run, whatif_summary

    def row(step, layer, role, sqnr, under, **extra):
        return {"step": step, "layer": layer, "role": role, "spec": "s", "underflow": under,
                "saturation": 0.0, "sqnr_db": sqnr, **extra}  # fmt: skip

    rows = [row(1, "a", "forward.input", 30.0, 0.0), row(1, "a", "forward.input", 9.0, 0.5, whatif="mxfp4")]
    rows += [row(2, "a", "forward.input", 31.0, 0.0)]
    rows += [
        row(2, f, "forward.input", s, u, whatif="mxfp4") for f, s, u in (("a", 12.0, 0.1), ("b", 7.5, 0.2))
    ]
    (tmp_path / "numerics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    assert [r["sqnr_db"] for r in run.numerics] == [30.0, 31.0]  # the plan's own casts only
    # The last step's what-if rows, worst over the layers: b has the lowest SQNR, a and b the worst underflow.
    assert whatif_summary(run) == [
        {"step": 2, "whatif": "mxfp4", "role": "forward.input", "spec": "s", "layers": 2,
         "max_underflow": 0.2, "max_saturation": 0.0, "min_sqnr_db": 7.5, "worst_layer": "b"}
    ]  # fmt: skip
    page = build_report([tmp_path], tmp_path / "out").read_text()
    table = re.search(r'<table id="whatif">(.*?)</table>', page).group(1)
    assert re.findall(r"<td>(.*?)</td>", re.findall(r"<tr>(.*?)</tr>", table)[1]) == [
        "mxfp4", "forward.input", "s", "2", "0.2", "0", "7.5", "b"
    ]  # fmt: skip


def _metrics(folder, rows, steps=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if steps is not None:
        (folder / "config.json").write_text(json.dumps({"training": {"steps": steps}}))


def _row(step, loss, tps, first=None):
    row = {"step": step, "loss_metrics/global_avg_loss": loss, "throughput(tps)": tps}
    return row if first is None else {**row, "lbt/first_log_of_start": first}


def test_final_is_the_last_step_and_throughput_leaves_out_each_start(tmp_path):
    from low_bits_training.report.runs import load_run

    # 6 steps, log_freq 5 (the writer adds the last step), killed after step 5, resumed from step 4 (redoes 5)
    rows = [_row(1, 8.0, 150.0, True), _row(5, 6.0, 2000.0, False), _row(5, 6.1, 170.0, True),
            _row(6, 5.5, 2100.0, False)]  # fmt: skip
    _metrics(tmp_path / "run", rows, steps=6)
    run = load_run(tmp_path / "run")
    assert (run.last_step, run.total_steps, run.final_loss) == (6, 6, 5.5)
    assert run.tps == 2100.0  # the resumed start's step 5 (170 tok/s) replaced the first start's; left out
    assert run.summary()["final_step"] == "6/6"
    _metrics(tmp_path / "short", [_row(1, 8.0, 150.0, True)], steps=4)
    short = load_run(tmp_path / "short")
    assert math.isnan(short.tps) and short.summary()["final_step"] == "1/4"  # no warm-up tok/s, cut short
    _metrics(tmp_path / "old", [_row(1, 8.0, 150.0), _row(2, 7.0, 1900.0), _row(3, 6.9, 2100.0)])
    old = load_run(tmp_path / "old")  # written before the first-row flag: the first row is the warm-up
    assert (old.tps, old.final_loss, old.summary()["final_step"]) == (2000.0, 6.9, "3")


def test_step_cell():
    from low_bits_training.report.runs import step_cell

    assert step_cell([12], 12) == "12/12" and step_cell([10, 12, 12], 12) == "10-12/12"
    assert step_cell([12], None) == "12" and step_cell([], 12) == "-"


def test_report_table_says_which_step_the_final_loss_is_from(tmp_path):
    from low_bits_training.report.build import build_report

    _metrics(tmp_path / "a", [_row(1, 8.0, 150.0, True), _row(5, 6.0, 2000.0, False), _row(6, 5.5, 2100.0, False)],
             steps=6)  # fmt: skip
    page = build_report([tmp_path / "a"], tmp_path / "out").read_text()
    table = re.search(r'<table id="numbers">(.*?)</table>', page).group(1)
    head, row = re.findall(r"<tr>(.*?)</tr>", table)
    cells = dict(zip(re.findall(r"<th>(.*?)</th>", head), re.findall(r"<td>(.*?)</td>", row), strict=True))
    assert (cells["final step"], cells["final loss"], cells["median tok/s/proc"]) == ("6/6", "5.5", "2050")


def test_the_autopilots_decisions_get_their_own_table(tmp_path):
    from low_bits_training.report.build import build_report
    from low_bits_training.report.runs import load_run

    _metrics(tmp_path, [_row(1, 8.2, 100.0), _row(2, 8.1, 100.0)], steps=2)
    decision = {"step": 1, "layer": "layers.1.feed_forward.w1", "role": "forward.input",
                "trigger": "nonfinite", "value": "forward.output", "before": "e2m5/none/rne/nosat",
                "after": "e4m3/none/rne/nosat", "rung": "e4m3"}  # fmt: skip
    spike = {"step": 2, "layer": "", "role": "", "trigger": "loss_spike", "value": 80.0, "before": "",
             "after": "", "rung": "", "seen": 2}  # fmt: skip
    (tmp_path / "autopilot.jsonl").write_text(json.dumps(decision) + "\n" + json.dumps(spike) + "\n")
    assert load_run(tmp_path).decisions == [decision, spike]
    page = build_report([tmp_path], tmp_path / "out").read_text()
    assert "(1 promotions, 1 rollbacks)</h2>" in page
    assert (
        '<img alt="autopilot_' in page
        and (tmp_path / "out" / f"autopilot_{load_run(tmp_path).name}.png").exists()
    )
    table = re.search(r'<table id="autopilot">(.*?)</table>', page).group(1)
    assert re.findall(r"<td>(.*?)</td>", re.findall(r"<tr>(.*?)</tr>", table)[1]) == [
        "1", "layers.1.feed_forward.w1", "forward.input", "nonfinite", "forward.output",
        "e2m5/none/rne/nosat", "e4m3/none/rne/nosat", "",
    ]  # fmt: skip


def test_the_share_of_gemm_flops_per_format_follows_phases_and_promotions(tmp_path):
    """Layer a (4 x 8) e4m3 everywhere, b (4 x 4) high until a phase from step 3 puts it in e2m1; the
    autopilot sends a's forward.input to high from step 2; 4 steps. FLOPs per GEMM per step go as in x out:
    e4m3 x e4m3: 3x32 + 2x32 + 2x2x32 = 288, high: 3x16 x 2 steps = 96, high x e4m3 (a's forward from step 2):
    3x32 = 96, e2m1 x e2m1: 3x16 x 2 steps = 96; of 576."""
    from low_bits_training.report.build import build_report
    from low_bits_training.report.runs import flop_shares, load_run

    roles = ["forward.input", "forward.weight", "dgrad.grad_output", "dgrad.weight", "wgrad.grad_output",
             "wgrad.input"]  # fmt: skip

    def specs(fmt):
        return {"specs": {r: None if fmt is None else {"format": fmt, "scaling": "tensor"} for r in roles}}

    _metrics(tmp_path, [_row(s, 8.0 - s / 10, 100.0) for s in range(1, 5)], steps=4)
    # "b": 2 x 2 run twice per token (an attention product of two heads, an expert weight with top_k 2)
    (tmp_path / "gemm_sizes.json").write_text(json.dumps({"a": [4, 8], "b": [2, 2, 4]}))
    phases = [
        {"label": "p1", "first_step": 1, "last_step": 2, "plans": {"a": specs("e4m3"), "b": specs(None)}},
        {"label": "p2", "first_step": 3, "last_step": 4, "plans": {"a": specs("e4m3"), "b": specs("e2m1")}},
        {"label": "eval", "first_step": 0, "last_step": 0, "plans": {"a": specs(None), "b": specs(None)}},
    ]
    (tmp_path / "precision_schedule.json").write_text(json.dumps(phases))
    promo = {"step": 2, "layer": "a", "role": "forward.input", "trigger": "saturation", "value": 0.1,
             "before": "e4m3/tensor/rne", "after": "high", "rung": "high", "seen": 0}  # fmt: skip
    (tmp_path / "autopilot.jsonl").write_text(json.dumps(promo) + "\n")
    shares = {r["format"]: r["share"] for r in flop_shares(load_run(tmp_path))}
    assert shares == {"e4m3 x e4m3": 0.5, "high": 1 / 6, "high x e4m3": 1 / 6, "e2m1 x e2m1": 1 / 6}
    page = build_report([tmp_path], tmp_path / "out").read_text()
    table = re.search(r'<table id="flops">(.*?)</table>', page).group(1)
    assert "<td>e4m3 x e4m3</td><td>50.0%</td>" in table


def test_the_byte_report_gets_its_tables(tmp_path):
    """state_bytes.json: the training states (computed and measured bytes per parameter) and the saved
    activations per module (hooks, allocator, as made)."""
    from low_bits_training.report.build import build_report

    _metrics(tmp_path, [_row(1, 8.2, 100.0), _row(2, 8.1, 100.0)], steps=2)
    side = {"bytes_per_param": {"params": 2.0, "exp_avg": 0.53125, "total": 2.53125},
            "formats": {"params": ["bf16"], "exp_avg": ["int4 codes"]}}  # fmt: skip
    saved = {"stored": 40296.0, "as_made": 82224.0, "allocator": 40296.5,
             "modules": {"layers.0": {"stored": 6716.0, "as_made": 13704.0, "allocator": 6716.4}}}  # fmt: skip
    budget = {"params": 10, "ranks": 1, "planned": side, "measured": side, "saved_bytes_per_token": saved}
    (tmp_path / "state_bytes.json").write_text(json.dumps(budget))
    page = build_report([tmp_path], tmp_path / "out").read_text()

    def rows(table_id):
        table = re.search(rf'<table id="{table_id}">(.*?)</table>', page).group(1)
        return [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", table)[1:]]

    assert rows("state_bytes") == [
        ["params", "bf16", "2", "2"], ["exp_avg", "int4 codes", "0.531", "0.531"], ["total", "", "2.531", "2.531"]
    ]  # fmt: skip
    assert rows("saved_bytes") == [
        ["layers.0", "6716", "6716", "13704"],
        ["total", "40296", "40296", "82224"],
    ]
    _metrics(tmp_path / "plain", [_row(1, 8.2, 100.0)], steps=1)  # no state_bytes.json: no tables
    plain = build_report([tmp_path / "plain"], tmp_path / "out2").read_text()
    assert 'id="state_bytes"' not in plain and 'id="peak_memory"' not in plain


def test_the_report_shows_the_planned_peak_beside_the_measured_one(tmp_path):
    """peak_memory.json (issue 39): the plan's parts at its peak, the planned and the measured peak, GiB."""
    from low_bits_training.report.build import build_report

    _metrics(tmp_path, [_row(1, 8.2, 100.0), _row(2, 8.1, 100.0)], steps=2)
    mib = 2**20
    plan = {"later_steps": 252 * mib, "parts": {"parameters": 24 * mib, "forward and backward": 182 * mib}}
    (tmp_path / "peak_memory.json").write_text(
        json.dumps({"planned": plan, "measured": {"peak": 256 * mib, "step": 2}})
    )
    page = build_report([tmp_path], tmp_path / "out").read_text()
    table = re.search(r'<table id="peak_memory">(.*?)</table>', page).group(1)
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", table)[1:]]
    assert rows == [
        ["parameters", "0.023"],
        ["forward and backward", "0.178"],
        ["planned peak, a later step", "0.246"],
        ["measured peak, step 2", "0.25"],
    ]
