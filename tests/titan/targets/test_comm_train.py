"""The low-bit communication preset trains on 2 FSDP2 ranks (gloo): its metrics show the bytes moved per step per
rank at the ratio the formats give, and its loss stays close to the same run with high-precision collectives.
Under ``backend = "torchao"`` the weights all-gather through torchao's own fp8 path (Float8Linear in its
emulated mode on a CPU), whose real payload matches the emulation's count."""

import pytest

from helpers import REPO, train

PRESET = REPO / "train_configs" / "recipes" / "debug_fsdp_lowbit_comm.toml"
STEPS = 6
RUN = ("--training.steps", str(STEPS), "--checkpoint.no-enable")
HIGH = ("--quantize.comm.all_gather.format", "high", "--quantize.comm.reduce_scatter.format", "high")
BLOCK = 128
"""The preset's reduce-scatter block: e4m3 codes (1 byte) + one fp32 scale per 128 elements."""


def _bytes(run) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("comm/")} for r in run.rows}


def test_two_fsdp_ranks_train_with_fp8_all_gather_and_sr_reduce_scatter(tmp_path):
    low = train(tmp_path / "low", *RUN, nproc=2, config=PRESET)
    high = train(tmp_path / "high", *RUN, *HIGH, nproc=2, config=PRESET)
    torchao = train(tmp_path / "torchao", *RUN, "--quantize.backend", "torchao", nproc=2, config=PRESET)

    per_step = _bytes(low)
    assert sorted(per_step) == list(range(1, STEPS + 1))
    steady = per_step[2]
    # The same collectives every step from step 2 (step 1 runs one all-gather of the output unit fewer).
    assert all(per_step[step] == steady for step in range(2, STEPS + 1)), per_step
    # Reduce-scatter: every parameter chunk divides into 128-blocks and gradients reduce in fp32, so each
    # chunk takes 1 byte per element + 4 bytes per block instead of 4 bytes per element.
    rs, rs_hp = steady["comm/reduce_scatter_bytes"], steady["comm/reduce_scatter_bytes_hp"]
    assert rs_hp % (4 * BLOCK) == 0 and rs == rs_hp // 4 * (1 + 4 / BLOCK)
    assert steady["comm/reduce_scatter_ratio"] == (1 + 4 / BLOCK) / 4
    # All-gather: FSDP2's param dtype is bf16 (2 bytes); the transformer blocks' weights (most of the bytes)
    # travel as e4m3 (1 byte + 8 bytes of scale and amax per weight), embeddings / output / norms as bf16.
    ag, ag_hp = steady["comm/all_gather_bytes"], steady["comm/all_gather_bytes_hp"]
    assert steady["comm/all_gather_ratio"] == pytest.approx(ag / ag_hp)
    assert 0.55 < ag / ag_hp < 0.65, ag / ag_hp  # measured 0.602
    assert not _bytes(high)[1]  # no [quantize.comm]: no hooks, no counters
    # torchao's fp8 all-gather: the bytes it really gathers are ours less the 8 bytes of scale + amax we count
    # per weight and call (torchao all-reduces its scales apart); the reduce-scatter is ours in both.
    ao = _bytes(torchao)[2]
    assert ao["comm/all_gather_bytes_hp"] == ag_hp and ao["comm/reduce_scatter_bytes"] == rs
    gap = ag - ao["comm/all_gather_bytes"]
    assert 0 < gap < 1000 and gap % 8 == 0, gap  # measured: 480 = 8 x 30 weights x 2 gathers

    assert sorted(high.losses) == sorted(low.losses) == list(range(1, STEPS + 1))
    assert low.losses[STEPS] < low.losses[1] - 0.3, low.losses  # it trains
    for step in low.losses:  # measured: at most 7e-4 apart over 6 steps
        assert abs(low.losses[step] - high.losses[step]) < 0.01, (low.losses, high.losses)
        assert abs(torchao.losses[step] - high.losses[step]) < 0.01, (torchao.losses, high.losses)
    assert low.losses != high.losses  # the collectives really were quantized
