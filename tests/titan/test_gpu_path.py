"""What a first GPU run meets (issue 29), held on the CPU: torchao's fp8-store guard is active wherever our path
builds torchao's modules, the launcher refuses several CPU ranks where GPUs were meant, and every command-line
form of a choice or a list of tables either works or ends in one line naming the flag."""

from __future__ import annotations

import pytest

from helpers import DEBUG_TOML, REPO
from low_bits_training.config.tree import ConfigError
from low_bits_training.titan.launch import launcher
from low_bits_training.titan.launch.configure import load_config
from low_bits_training.titan.platform import compat

CONFIGS = REPO / "train_configs"

# --- torchao's guard against Triton's fp8-store miscompile (triton-lang/triton#11111) ------------------------


@pytest.fixture
def unguarded(monkeypatch):
    """Inductor's Triton min/max codegen in torch's own form (``tl.maximum(a, b, tl.PropagateNan.ALL)``,
    whether or not an earlier test applied the guard) and torchao's once-only flag cleared; both put back
    after the test."""
    from torch._inductor.codegen.triton import TritonOverrides
    from torchao.float8 import _inductor_patch

    for name in ("maximum", "minimum"):
        torchs = staticmethod(lambda a, b, f=name: f"tl.{f}({a}, {b}, tl.PropagateNan.ALL)")
        monkeypatch.setattr(TritonOverrides, name, torchs)
    monkeypatch.setattr(_inductor_patch, "_PATCHED", False)
    assert not compat.fp8_stores_guarded()


def _linear_config():
    from torchtitan.models.common.linear import Linear

    return Linear.Config(in_features=64, out_features=32, bias=False)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
def test_our_torchao_modules_apply_the_guard_when_built(unguarded, recipe):
    from low_bits_training.config.backends import TorchaoOptions
    from low_bits_training.nn import LinearPlan
    from low_bits_training.titan.plan.torchao_backend import layer_config

    plan = LinearPlan.from_recipe(recipe)
    plan = LinearPlan(plan.specs, backends=("torchao_emulated",) * 3)
    cfg = layer_config(_linear_config(), plan, TorchaoOptions())
    assert not compat.fp8_stores_guarded()
    cfg.build()
    assert compat.fp8_stores_guarded()


def test_a_base_converted_by_torchtitans_float8_converter_gets_the_guard(unguarded):
    from low_bits_training.titan.plan.torchao_backend import guard_torchao_modules, torchao_modules_in

    plain = compat.config_function("llama3", "llama3_debugmodel").model_spec.model
    assert not guard_torchao_modules(plain) and not compat.fp8_stores_guarded()
    model = compat.config_function("llama3", "llama3_debugmodel_float8_emulate_lora").model_spec.model
    assert "layers.0.feed_forward.w1" in torchao_modules_in(model)
    assert guard_torchao_modules(model) and compat.fp8_stores_guarded()


def test_the_rank_applies_the_guard_for_a_torchtitan_converted_base(unguarded):
    from low_bits_training.titan.launch import worker

    worker.build_config(
        ["--config-file", str(DEBUG_TOML), "--job.base", "llama3:llama3_debugmodel_float8_emulate_lora"]
    )
    assert compat.fp8_stores_guarded()


def test_the_guard_keeps_the_values():
    # The tl.where form propagates a NaN from either operand as tl.maximum(..., PropagateNan.ALL) does.
    compat.guard_fp8_stores()
    from torch._inductor.codegen.triton import TritonOverrides

    assert TritonOverrides.maximum("a", "b") == "tl.where((a > b) | (a != a), a, b)"
    assert TritonOverrides.minimum("a", "b") == "tl.where((a < b) | (a != a), a, b)"


# --- several ranks, no accelerator --------------------------------------------------------------------------


def test_several_cpu_ranks_are_refused_where_gpus_were_meant():
    refuse = launcher.accelerator_refusal
    driver = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05"
    why = refuse(8, driver, None, "12.9")
    assert why.startswith("NGPU x nodes = 8: this machine has an NVIDIA driver (NVRM version")
    assert "torch is a CUDA 12.9 build" in why and "LBT_ALLOW_CPU_RANKS=1" in why and "\n" not in why
    why = refuse(8, None, 8_030_261_248, None)
    assert why.startswith("NGPU x nodes = 8: no GPU is visible, so this would train a 8.0B-parameter model")
    assert refuse(2, None, 6_163_712, None) is None  # the debug model on 2 gloo ranks (README, tests)
    assert refuse(1, driver, 8_030_261_248, "12.9") is None  # one process: a CPU run is always allowed


def test_the_launcher_refuses_before_any_rank_starts(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "nvidia_driver", lambda: None)
    monkeypatch.delenv(launcher.ALLOW_CPU_RANKS, raising=False)
    args = ["--nproc_per_node=2", "--", "--config-file", str(DEBUG_TOML), "--job.base", "llama3:llama3_8b"]
    assert launcher.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("low-bits-training: config error: NGPU x nodes = 2: no GPU")
    monkeypatch.setattr(launcher, "nvidia_driver", lambda: "nvidia-smi")
    small = ["--nproc_per_node=2", "--", "--config-file", str(DEBUG_TOML), "--training.steps", "0"]
    assert launcher.main(small) == 2  # the debug model with a driver present: refused too
    assert "NVIDIA driver (nvidia-smi) but torch sees no GPU" in capsys.readouterr().err
    monkeypatch.setenv(launcher.ALLOW_CPU_RANKS, "1")
    assert launcher.main(small) == 2  # allowed: now refused only for steps = 0
    assert "training.steps = 0" in capsys.readouterr().err


# --- the command line -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--activation_checkpoint", "selective"],
        ["--activation-checkpoint=selective"],
        ["activation-checkpoint:selective"],  # tyro's own spelling
    ],
)
def test_a_choice_takes_its_name_as_a_flag_value(args):
    config = load_config(DEBUG_TOML, [*args, "--activation_checkpoint.preserve_rng_state", "False"])
    assert type(config.activation_checkpoint).__qualname__ == "SelectiveAC.Config"
    assert config.activation_checkpoint.preserve_rng_state is False


def test_choice_fields_and_lists_of_tables_from_the_command_line():
    config = load_config(
        DEBUG_TOML,
        ["--activation_checkpoint", "memory-budget", "--activation_checkpoint.memory_budget", "0.3",
         "--quantize.rules", '[{layers = ["layers.0.*"], format = "e4m3"}]'],
    )  # fmt: skip
    assert config.activation_checkpoint.memory_budget == 0.3
    assert config.quantize.rules[0].layers == ["layers.0.*"] and config.quantize.rules[0].format == "e4m3"
    assert load_config(DEBUG_TOML, ["--quantize.rules", "[]"]).quantize.rules == []


@pytest.mark.parametrize(
    "args, line",
    [
        (["--activation_checkpoint", "bogus"],
         "activation_checkpoint = 'bogus': expected one of 'selective', 'full', 'memory-budget', 'none'"),
        (["--activation_checkpoint.mode", "selective"],
         "--activation_checkpoint.mode: activation_checkpoint is 'none'; choose one of 'selective', 'full', "
         "'memory-budget', 'none' first (--activation_checkpoint <name>), then give its fields as "
         "--activation_checkpoint.<field> <value>"),
        (["--activation_checkpoint", "full", "--activation_checkpoint.mode", "x"],
         "unknown flag '--activation_checkpoint.mode'; allowed keys in [activation_checkpoint] "
         "(FullAC.Config): debug, determinism_check, preserve_rng_state"),
        (["--activation_checkpoint", "memory-budget", "--activation_checkpoint.memory_budget", "lots"],
         "activation_checkpoint.memory_budget = 'lots' (str): expected float"),
        (["--quantize.rules", "nope"],
         "--quantize.rules 'nope': expected a TOML inline array of tables, e.g. '[{layers = [\"layers.*\"], "
         "format = \"e4m3\"}]' (or write [[quantize.rules]] tables in the TOML file)"),
    ],
)  # fmt: skip
def test_a_refused_flag_is_one_line_naming_it(args, line):
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG_TOML, args)
    assert str(e.value) == line


@pytest.mark.parametrize("args", [["--training.steps", "3", "4"], ["--compile.components", "model", "bogus"]])
def test_tyros_own_parser_failure_names_the_flag(args):
    # tyro's report of these fails itself ("Could not create CLI parser from the provided type", about
    # another field's type); the line names the flag and its values instead.
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG_TOML, ["--metrics.log_freq", "2", *args])
    assert str(e.value) == (
        f"command line: {' '.join(args)}: refused (a value this flag does not take, or the wrong number of "
        "values; --help lists each flag's type, or set the key in the TOML file)"
    )


# --- the CUDA-graph policy -------------------------------------------------------------------------------


def _resolved(config_file, *flags):
    from low_bits_training.titan.launch.worker import build_config

    return build_config(["--config-file", str(config_file), *flags])


@pytest.mark.parametrize(
    "config_file, flags, reasons",
    [
        (CONFIGS / "recipes" / "debug_fp8_rowwise.toml", (), []),
        (CONFIGS / "recipes" / "debug_nvfp4.toml", (), []),  # SR, RHT, 2-D weight tiles: all capturable
        (CONFIGS / "recipes" / "debug_fp8_rowwise.toml", ("--quantize.recipe", "fp8_delayed"), []),
        (CONFIGS / "debug_numerics.toml", (), ["[numerics] statistics steps switch what the layers record"]),
        (CONFIGS / "recipes" / "debug_fsdp_lowbit_comm.toml", (),
         ["[quantize.comm] low-bit collectives keep their rounding keys and byte counts on the host"]),
        (CONFIGS / "debug_moe.toml", (),
         ["emulated MoE experts (the grouped GEMM reads its group offsets on the host)"]),
        (CONFIGS / "recipes" / "debug_nvfp4.toml", ("--quantize.autopilot.enable",),
         ["[quantize.autopilot] switches plans and redoes steps mid-run"]),
        (CONFIGS / "recipes" / "debug_fp8_rowwise.toml", ("--numerics.nonfinite", "skip"),
         ["numerics.nonfinite = 'skip' drops gradients the graph keeps"]),
    ],
)  # fmt: skip
def test_graph_policy_per_run(config_file, flags, reasons):
    from low_bits_training.titan.runtime.graphs import apply_graph_policy, graph_blockers

    config = _resolved(config_file, *flags)
    assert graph_blockers(config) == reasons
    assert config.training.disable_cuda_graphs  # a CPU run: off by the CPU defaults, nothing logged
    assert apply_graph_policy(config, on_cpu=True) is None
    config.training.disable_cuda_graphs = False  # as on a GPU node (torchtitan's default)
    line = apply_graph_policy(config, on_cpu=False)
    assert config.training.disable_cuda_graphs == bool(reasons)
    assert line == (f"CUDA graphs off: {'; '.join(reasons)}" if reasons else None)


def test_the_dispatcher_query_behind_the_mxfp8_cast_check():
    import torch

    assert "dispatch_has_kernel" in compat.UPSTREAM
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("aten::mm", "CPU")
    with pytest.raises(RuntimeError, match="does not exist"):
        has("lbt_no_such::op", "CUDA")


@pytest.mark.parametrize("preset", ["llama3_8b", "llama3_8b_fp8_rowwise", "llama3_8b_mxfp8"])
def test_the_8b_presets_state_their_profiler_and_checkpoint_cadence(preset):
    base = compat.config_function("llama3", "llama3_8b")
    assert base.profiler.enable_profiling and base.profiler.profile_freq == 100  # what they would inherit
    config = load_config(CONFIGS / f"{preset}.toml", [])
    assert not config.profiler.enable_profiling  # traces: llama3_8b_profiling.toml
    assert (config.checkpoint.interval, config.checkpoint.keep_latest_k) == (500, 2)
