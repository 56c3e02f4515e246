"""``lbt-speed`` on run configs: bad input in one line (exit 2), the plan of a preset resolved as on the
named GPU, and the targets it reads from the config tree (tokens, instances, experts, recompute)."""

import pytest

from helpers import CORPUS
from low_bits_training.cli import speed as cli
from low_bits_training.cli import speed_targets
from low_bits_training.speed import gpu, predict
from low_bits_training.speed.workloads import LLAMA3_8B, decoder_targets, recipe_plans


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--gpu", "A100"],
            "lbt-speed: config error: --gpu = 'A100': expected one of H100, H200, H200-NVL, B200",
        ),
        (
            ["--recipe", "fp9"],
            "lbt-speed: config error: --recipe = 'fp9': expected one of bf16, fp8_tensorwise",
        ),
        (["--dp", "0"], "lbt-speed: config error: --dp = 0: expected an int >= 1"),
        (
            ["--config-file", "nope.toml"],
            "lbt-speed: config error: CONFIG_FILE = 'nope.toml'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, line, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(line), err


def test_published_prints_the_comparison(capsys):
    assert cli.main(["--published"]) == 0
    out = capsys.readouterr().out
    assert "| torchao Llama3-8B mxfp8 (cuBLAS) | B200 | mxfp8 | step | 1.200 |" in out
    assert "within 15%." in out


@pytest.fixture(scope="module")
def debug_moe():
    # module-scoped: conftest's corpus redirection is per test, so the corpus is named here
    return speed_targets.load_config(
        "train_configs/debug_moe.toml", ["--dataloader.dataset_path", str(CORPUS)]
    )[0]


def test_targets_of_a_moe_preset(debug_moe):
    plans, shapes = speed_targets.resolved(debug_moe, gpu("B200").hardware())
    targets = {t.fqn: t for t in speed_targets.run_targets(debug_moe, plans, shapes, 8)}
    w1 = targets["layers.0.moe.routed_experts.inner_experts.w1"]
    # 8 sequences of 256 tokens, each routed to 2 of 8 experts; the three grouped GEMMs carry all 8 weights
    assert (w1.kind, w1.tokens, w1.groups, w1.in_features, w1.out_features) == (
        "experts",
        8 * 256 * 2,
        8,
        128,
        128,
    )
    assert w1.recompute == 0.0  # activation_checkpoint = "none"
    wo = targets["layers.0.attention.wo"]
    assert (wo.kind, wo.tokens) == ("linear", 8 * 256)
    assert not w1.plan.is_high_precision and wo.plan.is_high_precision  # MXFP8 on the experts only


def test_debug_model_report_on_two_gpus(capsys, tmp_path):
    argv = ["--config-file", "train_configs/debug_model.toml", "--gpu", "H100", "--gpu", "B200", "--recipe", "mxfp8", "--layers",
            "--dump_folder", str(tmp_path / "run")]  # fmt: skip  # not the checkout's outputs/ (issue 41)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "H100: step speedup over bf16" in out and "B200: step speedup over bf16" in out
    assert "this package on H100: 100% of the quantized GEMM FLOPs emulated" in out  # no MX kernels on SM90
    assert "| layers.*.attention.qk | qk | 6 | 256x16x256 | bf16/bf16/bf16 |" in out  # 8 x 16 heads each


def test_the_8b_preset_resolves_to_the_published_setups_targets():
    """lbt-speed on llama3_8b_mxfp8.toml (the tokenizer is not here: shapes read without it) predicts what
    the published-figures setup of Llama 3 8B predicts: same linears, attention, recompute, plan."""
    config, note = speed_targets.load_config("train_configs/llama3_8b_mxfp8.toml", [])
    assert note.startswith("note: tokenizer absent here")
    pred, _ = speed_targets.predict_run(config, gpu("B200"), None, 8)
    ours = decoder_targets(LLAMA3_8B, 1, 8192, recipe_plans("mxfp8"), recompute=0.5)

    def keys(targets):
        return sorted((t.fqn, t.in_features, t.out_features, t.tokens, t.count, t.recompute) for t in targets)

    assert keys(r.target for r in pred.rows) == keys(ours)
    assert pred.speedup == pytest.approx(predict(ours, gpu("B200")).speedup, rel=1e-12)


def _parts(line: str) -> dict[str, float]:
    """``{part: GiB}`` of a planned peak's line (``PeakPlan.summary``)."""
    inside = line.split("at the peak, in the ")[1].split(": ", 1)[1].rstrip(")")
    return {p.rsplit(" ", 1)[0]: float(p.rsplit(" ", 1)[1]) for p in inside.split(", ")}


def test_the_report_plans_the_peak_a_rank_on_its_ranks(capsys, tmp_path):
    base = [
        "--config-file",
        "train_configs/debug_model.toml",
        "--gpu",
        "H100",
        "--dump_folder",
        str(tmp_path),
    ]
    lines = {}
    for dp in (1, 8):
        assert cli.main([*base, "--dp", str(dp), "--training.local_batch_size", "2"]) == 0
        lines[dp] = next(
            x for x in capsys.readouterr().out.splitlines() if x.startswith("peak memory a rank")
        )
    assert lines[1].startswith("peak memory a rank, on 1 ranks: ") and "on 8 ranks: " in lines[8]
    one, eight = _parts(lines[1]), _parts(lines[8])
    # FSDP2 over 8 ranks keeps an eighth of the AdamW states and parameters a rank (0.05 GiB -> 0.01)
    assert one["optimizer states"] >= 4 * eight["optimizer states"] > 0
