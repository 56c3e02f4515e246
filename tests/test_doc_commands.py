"""Every shell command in README.md and docs/*.md does what its doc says (issue 30).

A command is a line of a fenced ``bash`` block (continuation lines joined, comments dropped). Each one is in
exactly one of the lists below:

- ``RUN``: run here, in a clean copy of the repository (its tracked files, committed in a fresh git repo,
  ``.venv`` linked), shortened with the flags a user would add; afterwards ``git status`` is empty: no
  documented command writes into tracked files;
- ``COVERED``: the same entry point and flags are run by the named test;
- ``NEEDS``: what this CPU machine lacks (a GPU, the network, slurm), or a debugger session, or minutes to
  hours of benchmark; the note says why.

A command added to the docs, or changed there, fails ``test_every_documented_command_is_listed`` until it
is placed; a listed command no longer in the docs fails it too. Blocks that hold commands but are not
labelled ``bash`` fail ``test_command_blocks_are_labelled_bash``. The runs are the slow tier (about 4-5
minutes on 2 cores: four trainings of 2-6 steps and a few checks).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^ *```", re.M | re.S)
COMMAND_LIKE = re.compile(r"^(\./|\.venv/bin/|scripts/|lbt-|python3? |pip |git |gdb |env |[A-Z_]+=\S+ )")
SMALL = "--training.local_batch_size 2 --training.seq_len 128"
"""What a user adds to make a debug run quick (the shape the tests use)."""


def _strip_comment(line: str) -> str:
    # A '#' that starts a word outside quotes starts a comment.
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _commands(block: str) -> list[str]:
    out, pending = [], ""
    for raw in block.splitlines():
        line = _strip_comment(raw).strip()
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            out.append(" ".join(line.split()))
    return out


def blocks() -> list[tuple[str, int, str, str]]:
    """(file, line, language, text) of every fenced block (indented fences included, dedented)."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            indent = len(m.group(1))
            body = "\n".join(ln[indent:] for ln in m.group(3).splitlines())
            out.append((path.name, text.count("\n", 0, m.start()) + 1, m.group(2), body))
    return out


def documented() -> dict[str, str]:
    """command -> where it is documented (``file:line``; the first place)."""
    found: dict[str, str] = {}
    for name, line, lang, body in blocks():
        if lang == "bash":
            for cmd in _commands(body):
                found.setdefault(cmd, f"{name}:{line}")
    return found


# --- The lists ----------------------------------------------------------------------------------------------

RUN: dict[str, str] = {
    # README: the first command, shortened; then again: "nothing to do"; lbt-report on its folder.
    "./run_llama_train.sh": f"./run_llama_train.sh --training.steps 2 {SMALL}",
    "NGPU=2 ./run_llama_train.sh --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule "
    "1F1B": "NGPU=2 ./run_llama_train.sh --parallelism.pipeline_parallel_degree 2 "
    f"--parallelism.pipeline_parallel_schedule 1F1B --training.steps 2 {SMALL} --dump_folder outputs/pp",
    "python -m low_bits_training.cli.report RUN_DIR [RUN_DIR ...] -o OUT": (
        "python -m low_bits_training.cli.report outputs/debug_model -o {tmp}/report"
    ),
    ".venv/bin/pre-commit install": ".venv/bin/pre-commit install",
    # experiments.md
    "env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=localhost MASTER_PORT=29517 "
    ".venv/bin/python -m low_bits_training.titan.launch.worker --config-file train_configs/debug_model.toml "
    "--dump_folder /tmp/single --training.steps 2 --training.local_batch_size 2 --training.seq_len 128 "
    "--metrics.log_freq 1 --checkpoint.no-enable": "env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 "
    "MASTER_ADDR=localhost MASTER_PORT=29517 .venv/bin/python -m low_bits_training.titan.launch.worker --config-file "
    "train_configs/debug_model.toml --dump_folder {tmp}/single --training.steps 2 --training.local_batch_size 2 "
    "--training.seq_len 128 --metrics.log_freq 1 --checkpoint.no-enable",
    "DRY_RUN=1 ./submit.sh": "DRY_RUN=1 ./submit.sh",
    "lbt-sweep --grid-file sweeps/precision.toml --collect": "lbt-sweep --grid-file sweeps/precision.toml --collect",
    "lbt-scaling --config-file train_configs/debug_model.toml --nproc 1,2 -- --training.steps 6 "
    "--training.local_batch_size 2 --training.seq_len 128 --checkpoint.no-enable": "lbt-scaling --config-file "
    "train_configs/debug_model.toml --nproc 1,2 -- --training.steps 6 --training.local_batch_size 2 "
    "--training.seq_len 128 --checkpoint.no-enable",
    # experiments.md / precision_plan.md: the Llama 3.1 tokenizer is not in a fresh clone (a WARN, the plan shown)
    "lbt-doctor --config-file train_configs/llama3_8b_mxfp8.toml --recipe fp8_rowwise --hardware sm100": (
        "lbt-doctor --config-file train_configs/llama3_8b_mxfp8.toml --recipe fp8_rowwise --hardware sm100"
    ),
    # nvfp4_ablation.md: collecting where nothing ran (a fresh clone) says so and writes nothing
    ".venv/bin/python benchmarks/nvfp4_ablation.py --out /tmp/ablation/runs --collect": (
        ".venv/bin/python benchmarks/nvfp4_ablation.py --out {tmp}/ablation/runs --collect"
    ),
}
"""Documented command -> the command as run here (``{tmp}``: this test's temporary folder)."""

SMOKE = "tests/titan/launch/test_train_smoke.py::test_two_ranks_train"
SWEEP = "tests/cli/test_sweep.py::test_real_sweep_writes_table_csv_and_plot"
COVERED: dict[str, str] = {
    "./run_tests.sh": "the runner of this very test",
    "./run_tests.sh -q": "the runner of this very test",
    "./run_tests.sh --all": "the runner of this very test (this file is in the --all tier)",
    "./run_tests.sh --all -q": "the runner of this very test (this file is in the --all tier)",
    "./run_tests.sh tests/formats -q": "the runner of this very test (tests/formats is part of every run)",
    "./run_llama_train.sh --training.steps 4": "test_doc_commands.py::test_readme_training_rerun_and_report",
    "NGPU=2 ./run_llama_train.sh --parallelism.data_parallel_shard_degree 2": SMOKE,
    # memory.md
    "lbt-doctor --config-file train_configs/optim/lowbit_adamw_int8.toml": (
        "tests/cli/test_doctor.py::test_state_bytes_row_and_checkpoint_estimate_follow_the_optimizer"
    ),
    "CONFIG_FILE=train_configs/optim/lowbit_adamw_int8.toml NGPU=2 ./run_llama_train.sh "
    "--parallelism.data_parallel_shard_degree 2 --training.steps 1 --checkpoint.no-enable": (
        "tests/titan/runtime/test_budget_train.py::test_state_bytes_computed_equal_measured"
    ),
    "NGPU=2 ./run_llama_train.sh --parallelism.tensor_parallel_degree 2": SMOKE,
    "CONFIG_FILE=train_configs/recipes/debug_fsdp_lowbit_comm.toml NGPU=2 ./run_llama_train.sh": (
        "tests/titan/targets/test_comm_train.py::test_two_fsdp_ranks_train_with_fp8_all_gather_and_sr_reduce_scatter"
    ),
    "CONFIG_FILE=train_configs/recipes/debug_fsdp_lowbit_comm.toml NGPU=2 ./run_llama_train.sh "
    "--checkpoint.no-enable --metrics.log_freq 5 --dump_folder /tmp/comm/m_low": (
        "tests/titan/targets/test_comm_train.py::test_two_fsdp_ranks_train_with_fp8_all_gather_and_sr_reduce_scatter"
    ),
    "lbt-doctor": "tests/cli/test_doctor.py::test_no_arguments_check_the_run_the_launcher_starts_by_default",
    "lbt-sweep --grid-file sweeps/precision.toml": SWEEP
    + " (and tests/test_shipped_examples.py: the grid file)",
    "lbt-sweep --config-file train_configs/debug_model.toml --name seeds --grid debug.seed=0,1,2 "
    "--grid training.steps=20 -- --training.local_batch_size 2": SWEEP,
    "OMP_NUM_THREADS=2 .venv/bin/python -m low_bits_training.cli.scaling --config-file "
    "train_configs/debug_model.toml --nproc 1,2 -- --training.steps 12 --training.local_batch_size 4 "
    "--training.seq_len 256 --checkpoint.no-enable": "test_doc_commands.py::test_sweep_submit_and_scaling "
    "(the same entry point; the table's numbers are dated measurements)",
    "OMP_NUM_THREADS=1 .venv/bin/python -m low_bits_training.cli.sweep --config-file "
    "train_configs/debug_model.toml --name recipes --grid "
    "quantize.recipe=bf16,fp8_tensorwise,fp8_rowwise,fp8_rowwise_hp_wgrad,deepseek_fp8,mxfp8,mxfp6,mxfp4,nvfp4,int8"
    " --baseline quantize.recipe=bf16 -- --training.local_batch_size 4 --training.steps 40 "
    "--checkpoint.no-enable --metrics.log_freq 1": SWEEP
    + " (and every recipe: tests/titan/targets/test_quantize_train.py)",
    "CONFIG_FILE=train_configs/recipes/debug_torchao_mixed.toml ./run_llama_train.sh --training.steps 6 "
    "--checkpoint.no-enable [--compile.enable]": (
        "tests/titan/targets/test_quantize_train.py::test_mixed_torchao_and_emulated_layers_train (the preset's plan)"
    ),
    "CONFIG_FILE=train_configs/recipes/debug_torchao_mixed.toml NGPU=2 ./run_llama_train.sh --training.steps 6 "
    "--checkpoint.no-enable --parallelism.data_parallel_shard_degree 2 [--compile.enable]": (
        "tests/titan/targets/test_quantize_train.py::test_mixed_torchao_and_emulated_layers_train (one rank) and "
        "tests/titan/targets/test_quantize_train.py::test_fsdp2_fp8_all_gather_through_torchao (two)"
    ),
    # speed_model.md
    "lbt-speed --config-file train_configs/llama3_8b.toml --recipe nvfp4 --gpu B200 --gpu H100 [--layers]": (
        "tests/speed/test_speed_cli.py::test_the_8b_preset_resolves_to_the_published_setups_targets"
    ),
    "lbt-speed --published": "tests/speed/test_speed_cli.py::test_published_prints_the_comparison",
    "scripts/gpu_check.sh --dry-run": "tests/speed/test_gpu_check.py::test_dry_run_lists_every_level_and_item",
    "scripts/gpu_check.sh --dry-run --wheelhouse /tmp/wheelhouse": (
        "tests/speed/test_gpu_check.py::test_dry_run_lists_every_level_and_item (a wheelhouse of its own)"
    ),
}
"""Documented command -> the test that runs the same entry point with the same flags."""

NEEDS: dict[str, str] = {
    "CONFIG_FILE=train_configs/llama3_8b.toml NGPU=8 ./run_llama_train.sh": "gpu: 8 GPUs; network: tokenizer, c4",
    "git clone <this repo> && cd low-bits-training": "network",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'": "network: pip (ensure_venv.sh does it too)",
    "CONFIG_FILE=train_configs/llama3_8b.toml NNODES=4 NGPU=8 RUN_NAME=fp8-8b ./submit.sh --training.steps 10000": (
        "slurm and gpu (submit.sh against fake sbatch / srun: tests/test_submit.py)"
    ),
    "RUN_NAME=fp8-8b ./submit.sh --training.steps 10000": "slurm (the resubmission: tests/test_submit.py)",
    "lbt-sweep --grid-file sweeps/precision.toml --slurm": (
        "slurm (against a fake sbatch: tests/cli/test_sweep.py::test_sweep_submits_each_point_through_submit_sh)"
    ),
    "env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=localhost MASTER_PORT=29517 gdb -ex r -ex bt --args "
    ".venv/bin/python -m low_bits_training.titan.launch.worker --config-file train_configs/debug_model.toml "
    "--training.steps 2": "a debugger session (interactive)",
    "gdb -ex 'set follow-fork-mode child' -ex r --args .venv/bin/python -m torch.distributed.run "
    "--nproc_per_node=1 -m low_bits_training.titan.launch.worker --config-file train_configs/debug_model.toml": (
        "a debugger session (interactive)"
    ),
    "gdb -p <PID> -batch -ex 'thread apply all bt'": "a debugger session on a running job",
    "OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_formats.py": "minutes: a benchmark (4 min; prints only)",
    "OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_linear.py --iters 2": "minutes: a benchmark (prints only)",
    ".venv/bin/python benchmarks/bench_numerics_overhead.py --micro": "minutes: a benchmark (prints only)",
    ".venv/bin/python benchmarks/bench_numerics_overhead.py --steps 21": (
        "minutes: a benchmark (trains into a temporary folder)"
    ),
    ".venv/bin/python benchmarks/nvfp4_ablation.py --jobs 3 --out /tmp/ablation/runs": (
        "minutes to an hour: 18 trainings (its --collect is run here; tests/test_nvfp4_ablation.py)"
    ),
    # speed_model.md
    "lbt-speed --presets --gpu H100 --gpu B200": "minutes: every preset x every recipe (prints the doc's tables)",
    "scripts/gpu_check.sh": "gpu (on a CPU: tests/speed/test_gpu_check.py runs its checks CPU against CPU)",
    "scripts/gpu_check.sh --levels 1 --out /tmp/gc": "gpu",
    "scripts/build_wheelhouse.sh --python-version 3.12 --dest /tmp/wheelhouse": (
        "network: pip download from PyPI (run by hand 2026-11-27: 37 wheels, 35 MiB)"
    ),
    "scripts/gpu_check.sh --wheelhouse /tmp/wheelhouse": "gpu (a node without network)",
    "scripts/gpu_check.sh --wheelhouse .whl --budget-s 380 --out $OUT/gc": "gpu (the first GPU run, 2026-11-28)",
    "python benchmarks/gemm_accumulation.py": (
        "gpu (its point is the CUDA rows; the bound they set: "
        "tests/speed/test_gpu_check.py::test_the_accumulation_bound_passes_an_fp32_sum_and_refuses_a_bf16_result)"
    ),
}
"""Documented command -> what it needs that the test machine lacks."""


# --- The lists keep up with the docs -------------------------------------------------------------------------


def test_every_documented_command_is_listed():
    docs = documented()
    listed = [*RUN, *COVERED, *NEEDS]
    assert len(listed) == len(set(listed)), "a command is in two lists"
    missing = {cmd: where for cmd, where in docs.items() if cmd not in listed}
    assert not missing, f"documented commands in no list of tests/test_doc_commands.py: {missing}"
    stale = sorted(set(listed) - set(docs))
    assert not stale, f"listed commands no longer in the docs: {stale}"


def test_the_covering_tests_exist():
    for where in COVERED.values():
        for path, name in re.findall(r"(tests/[\w/]+\.py|test_doc_commands\.py)::(\w+)", where):
            file = REPO / path if path.startswith("tests/") else Path(__file__)
            assert f"def {name}(" in file.read_text(), where


def test_command_blocks_are_labelled_bash():
    """A block that holds commands but is not ``bash`` would be missed by the lists above."""
    for name, line, lang, body in blocks():
        if lang in ("bash", "python", "toml"):
            continue
        commands = [ln for ln in body.splitlines() if COMMAND_LIKE.match(ln)]
        assert not commands, f"{name}:{line}: label this block bash: {commands}"


# --- The runs ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory):
    """The repository's tracked files (as in this working tree) committed in a fresh git repo, ``.venv``
    linked to this one's (ignored, as a user's is); returns (folder, environment)."""
    root = tmp_path_factory.mktemp("clone") / "low-bits-training"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = REPO / rel
        if src.is_file():  # a file deleted in the working tree but still tracked is left out
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "clean copy"]):
        subprocess.run([*git, *cmd], cwd=root, check=True, capture_output=True)
    (root / ".venv").symlink_to(REPO / ".venv")  # .gitignore's ".venv/" matches a folder, not a link:
    (root / ".git" / "info" / "exclude").write_text("/.venv\n")  # ignored as a user's .venv folder is
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "CONFIG_FILE", "NGPU", "LOG_RANK")}
    env.update(PATH=f"{root / '.venv' / 'bin'}:{env['PATH']}", PYTHONPATH=str(root))  # the copy's package
    assert not _status(root)
    return root, env


def _status(root: Path) -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout


def run(clean_copy, documented_command: str, tmp: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a documented command (as ``RUN`` shortens it) in the clean copy; its git status must stay empty."""
    root, env = clean_copy
    command = RUN[documented_command].format(tmp=tmp)
    p = subprocess.run(
        ["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert not _status(root), f"{command!r} wrote into tracked files:\n{_status(root)}"
    return p


def _rows(folder: Path) -> list[dict]:
    from low_bits_training.run.folder import read_metrics

    return read_metrics(folder)


@pytest.mark.slow
def test_readme_training_rerun_and_report(clean_copy, tmp_path):
    root, _ = clean_copy
    p = run(clean_copy, "./run_llama_train.sh", tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    folder = root / "outputs" / "debug_model"
    rows = _rows(folder)
    assert [r["step"] for r in rows] == [1, 2]  # log_freq 5: step 1, and the last step always
    assert all("mfu(%)" not in r for r in rows)  # no MFU against an A100's peak on the CPU
    assert not (folder / "comm_traces").exists()
    again = run(clean_copy, "./run_llama_train.sh", tmp_path)
    assert again.returncode == 0 and again.stderr.strip().splitlines()[-1].startswith(
        "low-bits-training: nothing to do: "
    ), again.stderr[-2000:]
    report = run(clean_copy, "python -m low_bits_training.cli.report RUN_DIR [RUN_DIR ...] -o OUT", tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    assert ">2/2<" in (tmp_path / "report" / "report.html").read_text()  # the final step, and of how many


@pytest.mark.slow
def test_pipeline_parallel_console_shows_the_loss(clean_copy, tmp_path):
    cmd = next(c for c in RUN if "pipeline_parallel_degree" in c)
    p = run(clean_copy, cmd, tmp_path)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    assert "the loss is on rank 1" in log and "run_train.sh" not in log
    losses = re.findall(r"\[rank1\]:.*step: +\d+ .*?loss: +([-\d.]+)", log)
    assert len(losses) == 2 and all(float(v) > 0 for v in losses), log[-3000:]


@pytest.mark.slow
def test_single_process_debugging_command_gives_the_documented_losses(clean_copy, tmp_path):
    cmd = next(c for c in RUN if c.startswith("env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1"))
    text = (REPO / "docs" / "experiments.md").read_text()
    documented_losses = [
        float(v) for v in re.search(r"# step 1 loss ([\d.]+), step 2 loss ([\d.]+)", text).groups()
    ]
    p = run(clean_copy, cmd, tmp_path)
    assert p.returncode == 0 and "Training completed" in p.stdout + p.stderr, p.stderr[-4000:]
    losses = {r["step"]: r["loss_metrics/global_avg_loss"] for r in _rows(tmp_path / "single")}
    assert [round(losses[1], 3), round(losses[2], 3)] == documented_losses


@pytest.mark.slow
def test_sweep_submit_and_scaling(clean_copy, tmp_path):
    root, _ = clean_copy
    dry = run(clean_copy, "DRY_RUN=1 ./submit.sh", tmp_path)
    assert dry.returncode == 0 and dry.stdout.startswith("sbatch --job-name=debug_model-"), dry.stderr
    name = dry.stdout.split()[1].removeprefix("--job-name=")
    assert "--gpus-per-node=1 " in dry.stdout and not (root / "outputs" / name).exists()  # nothing written
    ablation = run(clean_copy, ".venv/bin/python benchmarks/nvfp4_ablation.py --out /tmp/ablation/runs --collect",
                   tmp_path)  # fmt: skip
    assert ablation.returncode == 1 and "no run under" in ablation.stderr
    collect = run(clean_copy, "lbt-sweep --grid-file sweeps/precision.toml --collect", tmp_path)
    assert collect.returncode == 0 and "| quantize.recipe=bf16 (baseline) | 1 | 0/3 |" in collect.stdout
    hooks = run(clean_copy, ".venv/bin/pre-commit install", tmp_path)
    assert hooks.returncode == 0, hooks.stdout + hooks.stderr
    cmd = next(c for c in RUN if c.startswith("lbt-scaling"))
    scaling = run(clean_copy, cmd, tmp_path)
    assert scaling.returncode == 0, scaling.stdout[-3000:] + scaling.stderr[-3000:]
    rows = [ln.split("|") for ln in scaling.stdout.splitlines() if re.match(r"\| [12] \|", ln)]
    assert [r[6].strip() for r in rows] == ["6/6", "6/6"]  # the final loss is the last step's


@pytest.mark.slow
def test_doctor_on_the_8b_preset_warns_of_the_tokenizer_and_shows_the_plan(clean_copy, tmp_path):
    cmd = next(c for c in RUN if c.startswith("lbt-doctor --config-file train_configs/llama3_8b_mxfp8.toml"))
    p = run(clean_copy, cmd, tmp_path)
    rows = {c[0]: c[1:] for c in (ln.split("|")[1:4] for ln in p.stdout.splitlines()) if len(c) == 3}
    rows = {k.strip(): [v.strip() for v in vs] for k, vs in rows.items()}
    assert rows["config"][0] == "WARN", p.stdout[-3000:] + p.stderr[-3000:]
    assert rows["config"][1].startswith("hf_assets_path = './assets/hf/Llama-3.1-8B': none of tokenizer.json")
    assert "training stops here (the launcher exits 2)" in rows["config"][1]
    assert rows["backends"] == [
        "OK",
        "on CUDA SM100: 1 x Linear [high]; 160 x torchao MXFP8Linear (mxfp8 rceil) [torchao]",
    ]
    assert rows["recipe fp8_rowwise"] == [
        "OK",
        "on CUDA SM100: 1 x Linear [high]; 160 x torchao Float8Linear (rowwise) [torchao]",
    ]
    # the exit code depends on this machine's disk (the disk row); the launcher refuses the run itself:
    launcher = (".venv/bin/python -m low_bits_training.titan.launch.launcher --check-only -- "
                "--config-file train_configs/llama3_8b_mxfp8.toml")  # fmt: skip
    root, env = clean_copy
    refused = subprocess.run(["bash", "-c", launcher], cwd=root, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "low-bits-training: config error: " + rows["config"][1].split(": training stops here")[0]
    ], refused.stderr[-3000:]
    assert not _status(root)


@pytest.mark.slow
def test_the_readmes_two_commands_in_order(clean_copy, tmp_path):
    """Issue 41: the README's first command trains into the copy's ``outputs/`` and builds ``assets/``; the
    tests run after it must neither read nor change them (``tests/conftest.py``'s guard fails a test that
    changes them). Here: the first command with a flag, then the second (the fast tier, as ``./run_tests.sh``
    runs it) in the same copy."""
    root, env = clean_copy
    first = subprocess.run(
        ["bash", "-c", f"./run_llama_train.sh --training.steps 2 {SMALL}"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (root / "outputs" / "debug_model").is_dir() and (root / "assets" / "lbt_markov").is_dir()
    tests = subprocess.run(
        [".venv/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow or smoke"],
        cwd=root, env=env, capture_output=True, text=True, timeout=2400,  # 7.4 min alone; beside the full tier more
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout.splitlines()[-1] and "failed" not in tests.stdout.splitlines()[-1]
