"""What a first GPU run meets (issues 29 and 37), held on the CPU: torchao's fp8-store guard is active wherever
our path builds torchao's modules; the launcher (and a rank started without it) refuses a GPU node whose torch
sees no GPU, several CPU ranks where GPUs were meant, and more processes than visible GPUs, while
``--check-only`` plans for GPUs elsewhere; a crashed rank says why whatever LOG_RANK shows; pipeline
parallelism on a GPU node turns CUDA graphs off before torchtitan's own check; and every command-line form of
a choice or a list of tables either works or ends in one line naming the flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import DEBUG_TOML, REPO, train, write_toml
from low_bits_training.errors import ConfigError
from low_bits_training.titan.launch import failures, launcher
from low_bits_training.titan.launch.configure import load_config
from low_bits_training.titan.platform import compat, devices

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
    from low_bits_training.config.quantize import TorchaoOptions
    from low_bits_training.nn import LinearPlan
    from low_bits_training.titan.targets.torchao_backend import layer_config

    plan = LinearPlan.from_recipe(recipe)
    plan = LinearPlan(plan.specs, backends=("torchao_emulated",) * 3)
    cfg = layer_config(_linear_config(), plan, TorchaoOptions())
    assert not compat.fp8_stores_guarded()
    cfg.build()
    assert compat.fp8_stores_guarded()


def test_a_base_converted_by_torchtitans_float8_converter_gets_the_guard(unguarded):
    from low_bits_training.titan.targets.torchao_backend import guard_torchao_modules, torchao_modules_in

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


# --- no accelerator where GPUs were meant -------------------------------------------------------------------

DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05"
"""A driver too old for torch's CUDA 13 build (>= 580): torch sees no GPU."""


def test_several_cpu_ranks_are_refused_where_gpus_were_meant():
    refuse = launcher.accelerator_refusal
    why = refuse(8, DRIVER, None, "12.9")
    assert why == devices.cuda_refusal(DRIVER, False, "12.9")  # one home for the driver's line
    assert why.startswith("this machine has an NVIDIA driver (NVRM version")
    assert "torch is a CUDA 12.9 build" in why and "LBT_ALLOW_CPU_RANKS=1" in why and "\n" not in why
    assert "LBT_TORCH=keep" in why
    why = refuse(8, None, 8_030_261_248, None)
    assert why.startswith("NGPU x nodes = 8: no GPU is visible, so this would train a 8.0B-parameter model")
    assert refuse(2, None, 6_163_712, None) is None  # the debug model on 2 gloo ranks (README, tests)
    assert refuse(1, None, 8_030_261_248, "12.9") is None  # no driver, one process: any CPU run is allowed


def test_a_driver_without_cuda_is_refused_whatever_ngpu_says():
    # issue 37 item 3: NGPU=1 on a node whose driver is too old for torch trained on the CPU without a word
    assert launcher.accelerator_refusal(1, DRIVER, None, "13.0") == devices.cuda_refusal(
        DRIVER, False, "13.0"
    )
    assert (
        devices.cuda_refusal(DRIVER, True, "13.0") is None and devices.cuda_refusal(None, False, None) is None
    )
    assert "torch is a CPU-only build" in devices.cuda_refusal("nvidia-smi", False, None)


def test_this_machine_refusal_and_its_opt_out(monkeypatch):
    monkeypatch.setattr(devices, "nvidia_driver", lambda: DRIVER)
    why = devices.this_machine_refusal({})
    assert why == devices.cuda_refusal(DRIVER, False, torch.version.cuda)  # this CPU machine: no CUDA
    assert devices.this_machine_refusal({devices.ALLOW_CPU_RANKS: "1"}) is None
    monkeypatch.setattr(devices, "nvidia_driver", lambda: None)
    assert devices.this_machine_refusal({}) is None


def test_the_launcher_refuses_before_any_rank_starts(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "nvidia_driver", lambda: None)
    monkeypatch.delenv(devices.ALLOW_CPU_RANKS, raising=False)
    args = ["--nproc_per_node=2", "--", "--config-file", str(DEBUG_TOML), "--job.base", "llama3:llama3_8b"]
    assert launcher.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("low-bits-training: config error: NGPU x nodes = 2: no GPU")
    monkeypatch.setattr(launcher, "nvidia_driver", lambda: "nvidia-smi")
    for nproc in (2, 1):  # the debug model with a driver present: refused, one process too
        small = [f"--nproc_per_node={nproc}", "--", "--config-file", str(DEBUG_TOML), "--training.steps", "0"]
        assert launcher.main(small) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "NVIDIA driver (nvidia-smi) but torch sees no GPU" in err[0]
    monkeypatch.setenv(devices.ALLOW_CPU_RANKS, "1")
    assert launcher.main(small) == 2  # allowed: now refused only for steps = 0
    assert "training.steps = 0" in capsys.readouterr().err


def test_a_rank_started_without_the_launcher_is_refused_too(monkeypatch, capsys):
    # torchrun -m low_bits_training.titan.launch.worker directly: the rank refuses before it reads the config
    from low_bits_training.titan.launch import worker

    monkeypatch.setattr(devices, "nvidia_driver", lambda: DRIVER)
    monkeypatch.setattr(worker, "init_logger", lambda: None)  # no handler on capsys's stderr
    monkeypatch.delenv(devices.ALLOW_CPU_RANKS, raising=False)
    monkeypatch.delenv(worker.UNDER_LAUNCHER, raising=False)
    assert worker.main(["--config-file", str(DEBUG_TOML), "--training.stepz", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"low-bits-training: config error: {devices.cuda_refusal(DRIVER, False, torch.version.cuda)}"
    ]
    monkeypatch.setenv(devices.ALLOW_CPU_RANKS, "1")
    assert worker.main(["--config-file", str(DEBUG_TOML), "--training.stepz", "1"]) == 2
    assert "unknown flag '--training.stepz'" in capsys.readouterr().err  # allowed: the config is read


# --- planning on a login node (submit.sh) -------------------------------------------------------------------


def _submit_check(tmp_path, check_only: bool) -> list[str]:
    """The launcher's command line as submit.sh gives it for an 8B preset on 1 node x 8 GPUs (the built-in
    corpus in ``tmp_path`` in place of the preset's tokenizer)."""
    first = ["--check-only"] if check_only else []
    return [*first, "--nnodes=1", "--nproc_per_node=8", "--", "--config-file", str(CONFIGS / "llama3_8b.toml"),
            "--job.name", "x", "--dump_folder", str(tmp_path / "x"), "--checkpoint.enable",
            "--dataloader.dataset", "lbt_markov", "--dataloader.dataset_path", str(tmp_path / "markov")]  # fmt: skip


def test_check_only_plans_for_gpus_elsewhere(monkeypatch, tmp_path, capsys):
    # issue 37 item 8: submit.sh --check-only on a GPU-less login node refused every preset over 1B
    monkeypatch.setattr(launcher, "nvidia_driver", lambda: None)
    monkeypatch.delenv(devices.ALLOW_CPU_RANKS, raising=False)
    assert launcher.main(_submit_check(tmp_path, check_only=True)) == 0
    (note,) = capsys.readouterr().err.splitlines()  # the planned peak alone (no limit: nothing enforced)
    assert note.startswith(
        "low-bits-training: memory: 31.13 GiB on rank 0 (first step 23.65, later steps 31.13"
    )
    assert launcher.main(_submit_check(tmp_path, check_only=False)) == 2  # to train here: refused
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "NGPU x nodes = 8: no GPU is visible" in err[0]
    assert (
        launcher.main([*_submit_check(tmp_path, True), "--training.steps", "0"]) == 2
    )  # the rest is checked
    assert "training.steps = 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# --- NGPU against the GPUs this node has ---------------------------------------------------------------------


def test_ngpu_above_the_visible_gpus_is_refused_before_any_rank_starts(monkeypatch, capsys):
    # issue 37 item 4: each rank died in set_device, and LOG_RANK=0 hid why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))  # an H100 to the plan
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    args = ["--", "--config-file", str(DEBUG_TOML), "--training.steps", "0"]
    assert launcher.main(["--nproc_per_node=4", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"low-bits-training: config error: {devices.gpu_count_refusal(4, 2, '0,1')}"]
    assert err[0].endswith("NGPU = 4: only 2 GPU(s) visible on this machine (CUDA_VISIBLE_DEVICES='0,1'); "
                           "allowed: NGPU <= 2 (export NGPU=2), or widen CUDA_VISIBLE_DEVICES")  # fmt: skip
    assert launcher.main(["--nproc_per_node=2", *args]) == 2  # two fit: on to the config's own check
    assert "training.steps = 0" in capsys.readouterr().err
    assert devices.gpu_count_refusal(8, 0, None) is None  # no GPU: CPU ranks


# --- a crashed rank says why, whatever LOG_RANK shows ----------------------------------------------------------


def _failure(local_rank: int, exitcode: int, message):
    return SimpleNamespace(local_rank=local_rank, exitcode=exitcode, message=message)


def test_the_crash_report_names_the_exception_and_shows_a_hidden_ranks_traceback():
    recorded = {
        "message": "RuntimeError: boom",
        "extraInfo": {"py_callstack": "Traceback:\n  f()\nRuntimeError: boom\n"},
    }
    ranks = {0: _failure(0, -15, "Signal 15 (SIGTERM) received by PID 7"), 1: _failure(1, 1, recorded)}
    rank, failure = failures.crashed(ranks)  # not rank 0, which torchrun ended because rank 1 failed
    assert rank == 1
    assert failures.crash_report(1, failure, on_console=True) == (
        "low-bits-training: rank 1 failed (exit code 1): RuntimeError: boom; see its output above"
    )
    assert failures.crash_report(1, failure, on_console=False).splitlines() == [
        "[rank1]:Traceback:", "[rank1]:  f()", "[rank1]:RuntimeError: boom",
        "low-bits-training: rank 1 failed (exit code 1): RuntimeError: boom; its output is not on the console "
        "(LOG_RANK): its traceback above",
    ]  # fmt: skip
    bare = _failure(1, 1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    assert failures.crash_report(1, bare, on_console=False) == (
        "low-bits-training: rank 1 failed (exit code 1); its output is not on the console (LOG_RANK): "
        "LOG_RANK=1 shows it"
    )
    assert failures.crashed({0: ranks[0]})[0] == 0  # only signals: the lowest rank
    args = SimpleNamespace(local_ranks_filter="0")
    assert failures.shown(args, 0) and not failures.shown(args, 1)
    assert failures.shown(SimpleNamespace(local_ranks_filter=""), 1)


@pytest.mark.parametrize("method", ["fork", "spawn"])  # spawn: each rank a fresh interpreter, as on GPUs
def test_a_crash_on_a_rank_log_rank_hides_is_shown(tmp_path, method):
    from tests.titan.crash_override import MESSAGE

    run = train(
        tmp_path, "--training.steps", "2", "--checkpoint.no-enable",
        "--override.imports", "tests.titan.crash_override.crash_rank",
        nproc=2, check=False, env={"LOG_RANK": "0", "LBT_START_METHOD": method},
    )  # fmt: skip
    assert run.returncode == 1, run.log[-3000:]
    error = f"RuntimeError: rank 1 {MESSAGE}"
    assert f"[rank1]:{error}" in run.log.splitlines()  # its traceback's last line, from the error file
    assert run.log.strip().splitlines()[-1] == (
        f"low-bits-training: rank 1 failed (exit code 1): {error}; its output is not on the console "
        "(LOG_RANK): its traceback above"
    )


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
        (CONFIGS / "debug_one_gpu_twin.toml", (),  # the 8B one-GPU preset's state on the debug model
         ["optimizer_kwargs.in_backward updates parameters in the backward (a host read) and frees their gradients"]),
        (CONFIGS / "debug_lean.toml", (), []),  # the same low-bit state updated after the backward
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


PP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B")
"""The README's pipeline command's flags."""


def test_pipeline_parallelism_on_a_gpu_node_turns_graphs_off_before_torchtitans_check(monkeypatch, tmp_path):
    # issue 37 item 9: torchtitan's check (run by tyro as it reads the flags, and by build_config) refused PP
    # with CUDA graphs on before our policy could turn them off: the README's PP command exited 2 on a GPU
    from low_bits_training.titan.platform import cpu

    monkeypatch.setattr(cpu, "needs_cpu_adapters", lambda: False)  # as on a GPU node: no CPU defaults
    markov = ("--dataloader.dataset_path", str(tmp_path / "markov"))
    assert not _resolved(DEBUG_TOML, *markov).training.disable_cuda_graphs  # graphs stay on without PP
    assert _resolved(DEBUG_TOML, *PP, *markov).training.disable_cuda_graphs  # PP from the command line
    toml = write_toml(
        tmp_path / "pp.toml",
        parallelism={"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "1F1B"},
        dataloader={"dataset": "lbt_markov", "dataset_path": str(tmp_path / "markov")},
    )
    assert _resolved(toml).training.disable_cuda_graphs  # PP from the TOML, no flags: build_config's check
    with pytest.raises(ConfigError, match="CUDA graphs do not support pipeline parallelism"):
        _resolved(DEBUG_TOML, *PP, *markov, "--training.no-disable_cuda_graphs")  # asked for both: refused


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
