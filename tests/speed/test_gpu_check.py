"""``scripts/gpu_check.sh`` on this GPU-less machine (low_bits_training/speed/gpu_check): the dry run with a
wheelhouse, the budget, the refusal of a driver without CUDA, level 1 on the CPU build, the mxfp8 rows of a
simulated H100, and the recompile limit of compiled variants."""

import importlib.util
import json
import os
import shutil
import subprocess
from importlib.metadata import version

import pytest
import torch

from helpers import REPO, Scaled
from low_bits_training.formats import FORMATS
from low_bits_training.nn import hardware
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.speed.gpu_check import block, catalog, compiling, device, parity, processes, runner
from low_bits_training.titan.platform import devices

SCRIPT = str(REPO / "scripts" / "gpu_check.sh")


def _wheelhouse(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name in (
        "torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl",
        "torchao-0.17.0-py3-none-any.whl",
        "lbt_not_installed_pkg-1.2-py3-none-any.whl",
        "numpy-0.1-cp312-cp312-manylinux_2_28_x86_64.whl",
    ):
        (folder / name).write_bytes(b"")  # fmt: skip
    return folder


def test_dry_run_lists_every_level_and_item(tmp_path):
    folder = _wheelhouse(tmp_path)
    p = subprocess.run(
        [SCRIPT, "--dry-run", "--wheelhouse", str(folder)], capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("budget: 480 s (--budget-s); the items below sum to 480 s")
    assert "level 1 (torch only): 325 s; needs torch (installed)" in lines
    assert "level 3 (torchtitan): 90 s; needs torchao, torchtitan, datasets (installed)" in lines
    assert "  - block step time vs bf16: 195 s" in lines
    assert "  - _scaled_mm bit-exact: 10 s, runs on the CPU build too" in lines
    assert any(ln.startswith("without torchtitan (it needs torch >= 2.14.1") for ln in lines)
    assert (
        f"--wheelhouse {folder}: pip install --no-index --find-links {folder} --no-deps --target" in p.stdout
    )
    assert "2 of 4 wheels" in p.stdout
    assert "  install lbt_not_installed_pkg 1.2" in lines
    assert (
        "  install torchao 0.17.0 (this Python has 0.18.0)" in lines
    )  # pinned: another version is installed
    assert "  keep torchao 0.18.0 (this Python has 0.18.0)" in lines
    assert any(ln.startswith("  keep numpy 0.1 (this Python has ") for ln in lines)  # never shadowed


def test_dry_run_lines_name_each_levels_budget_and_needs(monkeypatch):
    # as with the pinned stack installed (scripts/torch_range.sh's venvs lack it)
    monkeypatch.setattr(catalog, "missing", lambda lv: [])
    lines = catalog.dry_run_lines(False, None, 100)
    assert lines[0].startswith("budget: 100 s (--budget-s)")
    assert [ln for ln in lines if ln.startswith("level ")] == [
        "level 0 (GPU-marked tests): 30 s; needs pytest (installed)",
        "level 1 (torch only): 325 s; needs torch (installed)",
        "level 2 (torchao): 35 s; needs torchao (installed)",
        "level 3 (torchtitan): 90 s; needs torchao, torchtitan, datasets (installed)",
    ]
    assert lines[-1] == "no --wheelhouse: levels 2-3 use what this Python has installed"
    assert sum(lv.budget_s for lv in catalog.LEVELS) == catalog.BUDGET_S == 480


def test_the_wheel_list_pins_the_stack_and_leaves_torch_out():
    wheels = dict(catalog.wanted_wheels())
    assert wheels["torchao"] == "0.18.0" and wheels["torchtitan"] == "0.3.0"
    assert not {"torch", "triton", "datasets", "pyarrow"} & set(wheels)
    assert not any(w.startswith("nvidia") for w in wheels)


def test_bad_levels_are_one_line_and_exit_code_2(tmp_path):
    cmd = [SCRIPT, "--levels", "1,7", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("gpu_check: config error: --levels = '1,7': expected")


def _entry():
    spec = importlib.util.spec_from_file_location("gpu_check_entry", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_driver_without_cuda_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    driver = "NVRM version: NVIDIA UNIX x86_64 Kernel Module 550.54"
    monkeypatch.setattr(devices, "nvidia_driver", lambda: driver)
    assert _entry().main(["--levels", "1", "--out", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().out.splitlines()
    assert line == f"gpu_check: {devices.cuda_refusal(driver, False, torch.version.cuda)}"
    assert line.startswith(f"gpu_check: this machine has an NVIDIA driver ({driver}) but torch sees no GPU")
    assert not (tmp_path / "gpu_check.json").exists()
    monkeypatch.setattr(runner, "import_failure", lambda code: None)  # no child importing torchao: fast
    assert _entry().main(["--dry-run"]) == 0  # the listing still works, and says what a run would do
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == f"a run here would stop: {devices.cuda_refusal(driver, False, torch.version.cuda)}"
    )


def test_the_graphs_off_line_is_the_workers():
    from low_bits_training.titan.runtime.graphs import GRAPHS_OFF

    assert processes.GRAPHS_OFF == GRAPHS_OFF


def test_a_small_budget_skips_what_does_not_fit(tmp_path, capsys):
    items = "backends per recipe,import survey,_scaled_mm bit-exact"
    assert runner.main(["--levels", "1", "--budget-s", "7", "--items", items, "--out", str(tmp_path)]) == 0
    rows = runner.load_json(tmp_path)["results"]
    assert [r["item"] for r in rows if r["status"] == "info"] == ["backends per recipe"] * len(
        catalog.RECIPES
    )
    skipped = {r["item"]: r["detail"] for r in rows if r["status"] == "skip"}
    assert skipped.keys() == {"import survey", "_scaled_mm bit-exact"}
    assert (
        skipped["import survey"].startswith("skip: needs ~30 s, ")
        and "s of --budget-s left" in skipped["import survey"]
    )
    assert "level 1 (torch only): " in capsys.readouterr().out
    assert runner.main(["--levels", "1", "--budget-s", "3", "--items", items, "--out", str(tmp_path)]) == 0
    assert {r["status"] for r in runner.load_json(tmp_path)["results"]} == {"skip"}


def test_level_1_runs_on_the_cpu_build(tmp_path):
    """The same command a GPU node runs: CUDA items skipped with the reason, the CPU-capable ones run; the
    compiled-kernel cache is the user's persistent one (nothing compiles in level 1 on a CPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    cmd = [SCRIPT, "--levels", "1", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    cache = (
        tmp_path / "xdg" / "low_bits_training" / f"inductor-{version('torch')}-torchao-{version('torchao')}"
    )
    assert f"TORCHINDUCTOR_CACHE_DIR={cache}" in p.stdout.splitlines()
    rows = runner.load_json(tmp_path)["results"]
    by = {}
    for r in rows:
        by.setdefault(r["item"], []).append(r)
    for name in (
        "casts cuda == cpu",
        "QuantLinear cuda == cpu",
        "CUDA graph replay == eager",
        "block step time vs bf16",
    ):
        assert [(r["status"], r["detail"]) for r in by[name]] == [("skip", "skip: no CUDA device visible")]
    assert [r["recipe"] for r in by["backends per recipe"]] == list(catalog.RECIPES)
    assert by["backends per recipe"][3]["linear"] == ["emulate"] * 3  # mxfp8 on the CPU
    exact = by["_scaled_mm bit-exact"]
    assert [(r.get("case"), r["status"]) for r in exact[:2]] == [("tensorwise", "ok"), ("rowwise", "ok")]
    assert {r["recipe"]: r["detail"] for r in exact[2:]} == {
        "mxfp8": "no _scaled_mm comparison: scaling block is not tensorwise/rowwise",
        "nvfp4": "no _scaled_mm comparison: format e2m1 is not e4m3/e5m2",
        "deepseek_fp8": "no _scaled_mm comparison: scaling block is not tensorwise/rowwise",
    }
    for r in by["_scaled_mm vs emulation"]:
        assert r["status"] == "ok" and 0 < r["max_rel_diff"] <= parity.BF16_ULP, r
    (acc,) = by["fp32-accumulate GEMM vs float64"]
    assert acc["status"] == "ok" and 0 < acc["error_units"] <= device.ACCUMULATE_BOUND, acc
    assert by["import survey"][0]["status"] == "ok"
    assert "| fp8_rowwise | linear emulate, experts emulate" in (tmp_path / "gpu_check.md").read_text()
    assert "level 1 (torch only): " in p.stdout


def test_mxfp8_is_a_skip_on_a_simulated_h100(monkeypatch):
    monkeypatch.setattr(parity, "detect_hardware", lambda: hardware.Hardware("cuda", (9, 0)))
    ran = []
    monkeypatch.setattr(
        parity, "torchao_vs_emulation", lambda r, d: ran.append(r) or parity.row("ok", recipe=r)
    )
    rows = {r["recipe"]: r for r in parity.torchao_rows(runner.Context("cuda", REPO, 0.0))}
    assert rows["mxfp8"]["status"] == "skip"
    assert rows["mxfp8"]["detail"] == "skip: MXFP8Linear kernels need CUDA SM100+, this is CUDA SM90"
    assert ran == ["fp8_tensorwise", "fp8_rowwise"]  # Float8Linear's kernels run on SM90
    assert rows["nvfp4_torchao"]["detail"] == "skip: NVFP4Linear kernels need CUDA SM100+, this is CUDA SM90"
    monkeypatch.setattr(parity, "detect_hardware", lambda: hardware.Hardware("cuda", (10, 0)))
    ran.clear()
    parity.torchao_rows(runner.Context("cuda", REPO, 0.0))
    assert ran == ["fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4_torchao"]  # torchao's NVFP4Linear: SM100
    no_triton = hardware.Hardware("cuda", (10, 0), triton=False)
    monkeypatch.setattr(parity, "detect_hardware", lambda: no_triton)
    rows = {r["recipe"]: r for r in parity.torchao_rows(runner.Context("cuda", REPO, 0.0))}
    assert (
        rows["nvfp4_torchao"]["detail"]
        == "skip: NVFP4Linear kernels are Triton, and Triton is not available here"
    )


def test_compile_variants_compiles_past_the_recompile_limit(monkeypatch):
    # The config module's own patch, not monkeypatch: pytest 9.2's undo deletes a setting it cannot find in
    # the module's __dict__, hiding it from every later compile in the process (CI of stop 34).
    limits = torch._dynamo.config.patch(
        recompile_limit=8, accumulated_recompile_limit=256
    )  # torch's defaults
    with limits:
        _compile_twelve_variants(monkeypatch)


def _compile_twelve_variants(monkeypatch):
    monkeypatch.setattr(compiling, "_VARIANTS", [0])
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fns = compiling.compile_variants([Scaled(k) for k in range(12)], backend=counting)
    x = torch.ones(3)
    assert [f(x)[0].item() for f in fns] == list(range(12))
    assert len(graphs) == 12  # each variant compiled; past 8 dynamo would have run the rest eagerly
    assert torch._dynamo.config.recompile_limit == 2 * 12 + 8
    torch._dynamo.reset()


def test_interleaving_rotates_the_order_of_recipes():
    calls = []

    def fn(name):
        def run(x):
            calls.append(name)
            return x.sum() * 1.0

        return run

    x, dy = torch.ones(2, requires_grad=True), torch.tensor(1.0)
    out = block.interleaved({n: fn(n) for n in "abc"}, x, dy, repeats=3, iters=1)
    assert calls == list("abcbcacab") and all(len(v) == 3 for v in out.values())


def test_block_ratios_on_a_small_cpu_block():
    ctx = runner.Context("cpu", REPO, float("inf"))
    s = block.BlockShape(dim=128, n_heads=4, n_kv_heads=2, ffn=256, tokens=64)
    res = block.measure(ctx, recipes=("bf16", "fp8_rowwise"), s=s, modes=("eager",), repeats=2, iters=1)
    assert res["bf16"]["backends"] == "high" and res["fp8_rowwise"]["backends"] == "emulate"
    assert res["bf16"]["eager"]["x_bf16"] == 1.0
    # a ratio of two medians, whatever it is (no bound on time: on a loaded machine either may be faster)
    assert 0 < res["fp8_rowwise"]["eager"]["x_bf16"] < float("inf")
    h100 = "NVIDIA H100 80GB HBM3"
    kernels, as_run = block.predicted(
        "fp8_rowwise", block.LLAMA3_8B_BLOCK, h100, hardware.Hardware("cuda", (9, 0))
    )
    assert kernels > 1 and as_run == kernels  # torchao's Float8Linear runs every linear on an H100
    kernels, as_run = block.predicted(
        "deepseek_fp8", block.LLAMA3_8B_BLOCK, h100, hardware.Hardware("cuda", (9, 0))
    )
    assert (
        as_run < 1 < kernels
    )  # emulated (no torchao module): slower than bf16, where kernels would be faster
    assert block.predicted("fp8_rowwise", block.LLAMA3_8B_BLOCK, "Some Other GPU") is None


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "bf16"])
def test_recipe_parity_check_runs_cpu_against_cpu(recipe):
    r = parity.recipe_parity(recipe, ("cpu", "cpu"))
    assert r["status"] == "ok" and r["max_rel_diff"] == 0.0, r


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cast_parity_check_runs_cpu_against_cpu(fmt):
    for rounding in parity.CAST_ROUNDINGS:
        assert parity.cast_parity(fmt, rounding, ("cpu", "cpu"))["status"] == "ok"


def test_the_accumulation_bound_passes_an_fp32_sum_and_refuses_a_bf16_result(monkeypatch):
    ctx = type("Ctx", (), {"device": "cpu"})()
    (fp32,) = device.accumulate_rows(ctx)
    assert fp32["status"] == "ok" and fp32["error_units"] <= 4 and fp32["fp32_error_units"] <= 4, fp32
    # a GEMM whose result is rounded to bf16 (what a missing out_dtype would give): thousands of units
    monkeypatch.setattr(device, "mm_fp32_accumulate", lambda a, b: torch.mm(a, b).bfloat16().float())
    (bf16,) = device.accumulate_rows(ctx)
    assert bf16["status"] == "fail" and bf16["error_units"] > 100 * device.ACCUMULATE_BOUND, bf16


def test_scaled_mm_is_bit_exact_on_exact_sums_and_the_check_sees_a_difference(monkeypatch):
    assert parity.scaled_mm_exact("cpu", rowwise=True, fast_accum=False)["status"] == "ok"
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: real(*a, **k) * (1 + 2.0**-20))
    bad = parity.scaled_mm_exact("cpu", rowwise=False, fast_accum=False)
    assert bad["status"] == "fail" and bad["detail"].startswith("differs: max rel")


def test_the_report_fills_the_recipe_table(tmp_path):
    rows = [
        {
            "item": "x",
            "status": "ok",
            "recipe": "mxfp8",
            "summary": {"eager x bf16": "0.50", "CUDA graph": "ok"},
        }
    ]
    text = (json.dumps(rows), runner.report.write(tmp_path, {"torch": "t"}, 10, {1: 2.0}, rows))[1]
    assert "| mxfp8 | - | 0.50 | - | - | - | ok |" in text
    assert "- level 1 (torch only): 2.0 s" in text
    assert runner.load_json(tmp_path)["results"] == rows


def test_a_level_whose_import_fails_is_skipped_with_the_reason(tmp_path, monkeypatch):
    """torchtitan 0.3.0 on torch 2.11 is installed but does not import: level 3 says so and runs nothing."""
    code = "raise ImportError('cannot import name set_timeout from torch.distributed')"
    monkeypatch.setitem(runner.IMPORTS, 3, code)
    monkeypatch.setattr(catalog, "missing", lambda lv: [])  # installed, as on a node with the wheelhouse
    rows = runner.run_level(catalog.level(3), runner.Context("cuda", tmp_path, float("inf")))
    why = f"skip: `{code}` fails on torch {torch.__version__}: ImportError: cannot import name set_timeout from torch.distributed"
    assert rows == [{"item": "level 3", "status": "skip", "detail": why, "level": 3}]
    monkeypatch.setitem(runner.IMPORTS, 2, "import sys")
    assert runner.level_refusal(catalog.level(2), runner.Context("cpu", tmp_path, 0.0)) is None


def _tiny_wheel(folder, name="lbt_probe_pkg", version="1.0"):
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 7\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def test_the_wheelhouse_installs_what_is_missing_into_a_temporary_folder(tmp_path, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    _tiny_wheel(tmp_path)
    (tmp_path / "numpy-0.1-py3-none-any.whl").write_bytes(b"")  # installed here: kept, never replaced
    target = runner.install_wheelhouse(tmp_path)
    assert sorted(p.name for p in target.iterdir()) == ["lbt_probe_pkg", "lbt_probe_pkg-1.0.dist-info"]
    assert sys.path[0] == str(target) and runner.os.environ["PYTHONPATH"] == f"{target}:/somewhere"
    import lbt_probe_pkg

    assert lbt_probe_pkg.VALUE == 7
    monkeypatch.delitem(sys.modules, "lbt_probe_pkg")
    shutil.rmtree(target)


def test_the_graph_checks_eager_step_is_keyed_and_sees_the_plan_switch(monkeypatch):
    """The eager half of the CUDA-graph check, on the CPU: a step repeats bit for bit under the same key, differs
    under another (nvfp4 rounds gradients stochastically) and after the plan switch."""
    from low_bits_training.nn import LinearPlan
    from low_bits_training.speed.gpu_check import graphs

    monkeypatch.setattr(
        graphs, "GRAPH_BLOCK", block.BlockShape(dim=128, n_heads=4, n_kv_heads=2, ffn=256, tokens=32)
    )
    b = graphs.quant_block(LinearPlan.from_recipe("nvfp4"), torch.device("cpu"))
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(32, 128, dtype=torch.bfloat16)
    try:
        first = graphs.eager_step(b, x, dy, 2)
        assert len(first) == 2 + len(list(b.parameters()))  # y, dx, every dW
        assert graphs._equal(graphs.eager_step(b, x, dy, 2), first)
        assert not graphs._equal(graphs.eager_step(b, x, dy, 3), first)
        graphs.set_plan(b, LinearPlan.from_recipe(graphs.SWITCH_TO))
        assert not torch.equal(graphs.eager_step(b, x, dy, 2)[0], first[0])
    finally:
        graphs.rng.set_step_key(None)


def test_the_trainings_peak_row_holds_the_plan_to_10_percent_either_way():
    def peak(planned, measured):
        return {"planned": {"later_steps": planned}, "measured": {"peak": measured}}

    assert processes.peak_row(peak(100, 108))["status"] == "ok"
    assert processes.peak_row(peak(100, 92))["status"] == "ok"
    assert processes.peak_row(peak(100, 75))["status"] == "fail"  # a plan far above: it refuses runs that fit
    under = processes.peak_row(peak(100, 115))  # a plan a run could OOM under
    assert under["status"] == "fail" and under["detail"].startswith(
        "planned 0.0 MiB, measured 0.0 MiB (+15.0%)"
    )
    assert processes.peak_row(None)["status"] == "info"
