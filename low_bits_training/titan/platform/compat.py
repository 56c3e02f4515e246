"""Every use of a private torchtitan / torch / torchao name, in one place (the CPU adapters excepted: ``cpu.py``).

Private names change without notice. Each shim here says which upstream line it answers, and ``UPSTREAM``
records where that code stood and a digest of its source in the pinned versions (torch 2.14.1, torchtitan
0.3.0); ``tests/titan/platform/test_compat.py`` fails when upstream changes any of them, so the shim is looked at
again instead of breaking at run time (the lines are also named in each shim's docstring). The rest of the package calls the shims, never the private names; the floors below titan, which may not import this module, reach the few they need through ``low_bits_training/upstream.py``, whose records ``UPSTREAM`` holds too.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from low_bits_training.upstream import INDUCTOR_AS_EAGER, RECORDS, Upstream, inductor_as_eager_here

UPSTREAM: dict[str, Upstream] = {
    "config_function": Upstream(
        "torchtitan.config.manager:ConfigManager._load_config",
        48,
        "778f7980bbc26d54",
        "resolve a base config function by name, exactly as torchtitan's --module/--config do",
    ),
    "metrics_rank": Upstream(
        "torchtitan.components.metrics:_get_metrics_rank",
        232,
        "b2011707dbc7e3bc",
        "the rank that logs metrics (last pipeline stage under PP): our metrics.jsonl is written there",
    ),
    "metric_logger": Upstream(
        "torchtitan.components.metrics:MetricsProcessor._build_metric_logger",
        365,
        "2f2ad8ced1ac1e99",
        "the hook MetricsProcessor builds its loggers in: we add the JSONL logger beside them",
    ),
    "checkpoint_save": Upstream(
        "torchtitan.components.checkpointer.dcp:CheckpointManager._save",
        379,
        "141755850802426a",
        "after a synchronous save: write the checkpoint's manifest",
    ),
    "checkpoint_load": Upstream(
        "torchtitan.components.checkpointer.dcp:CheckpointManager._load",
        474,
        "a14a16d11c876ae2",
        "before a load: verify the manifest; after it: start the run (write its config files)",
    ),
    "find_load_step": Upstream(
        "torchtitan.components.checkpointer.dcp:CheckpointManager._find_load_step",
        640,
        "d489b4c990523501",
        "which step a run resumes from, asked by the launcher before any rank starts",
    ),
    "checkpoint_id": Upstream(
        "torchtitan.components.checkpointer.dcp:CheckpointManager._create_checkpoint_id",
        686,
        "46015168fdc76f5d",
        "the folder of checkpoint step N",
    ),
    "profiler_running": Upstream(
        "torch.autograd.profiler:_is_profiler_enabled",
        0,
        "",  # a module-level flag: no source; the test checks what it says inside and outside a profiler
        "whether a profiler already records (two profilers cannot run at once)",
    ),
    "memory_categories": Upstream(
        "torch.profiler._memory_profiler:_CATEGORY_TO_COLORS",
        0,
        "",  # a table: the test compares its keys with memory_categories()
        "the order of the categories in export_memory_timeline's JSON (we draw the plot ourselves)",
    ),
    "fp8_store_guard": Upstream(
        "torchao.float8._inductor_patch:_patch_inductor_min_max_codegen",
        42,
        "e2de1f3b359def05",
        "torchao's guard against Triton's NaN/Inf fp8 stores (triton-lang/triton#11111), which torchao applies "
        "only in convert_to_float8_training; we build torchao's modules through config classes instead",
    ),
    "float8_grouped_experts": Upstream(
        "torchtitan.components.quantization.float8:_get_float8_grouped_experts_cls",
        179,
        "d99600deb1d500b3",
        "torchtitan's Float8GroupedExperts class for an experts module class (its MoE fp8 converter's own)",
    ),
    "mxfp8_grouped_experts": Upstream(
        "torchtitan.components.quantization.mx:_get_mxfp8_grouped_experts_cls",
        104,
        "2277066a8557068f",
        "torchtitan's MXFP8GroupedExperts class for an experts module class (its MoE MXFP8 converter's own)",
    ),
    "config_owner": Upstream(
        "torchtitan.config.configurable:Configurable.__init_subclass__",
        162,
        "4befc18bf4a1cc7b",
        "a nested Config class's ``_owner``: the module class its ``build()`` makes",
    ),
    "token_permute": Upstream(
        "torchtitan.models.common.token_dispatcher:TorchAOTokenDispatcher._permute",
        733,
        "b2e1d382df3284d5",
        "the padding dispatcher's permute, which titan/targets/expert_modules.py's PaddedTokenDispatcher overrides (triton-free)",
    ),
    "qwen3_builders": Upstream(
        "torchtitan.models.qwen3:_build_qwen3_moe_layers",
        134,
        "5a33447d848033c1",
        "torchtitan's Qwen3-MoE layer builder (and its _qwen3_norm, _EMBEDDING_INIT, _LINEAR_INIT), for the "
        "CPU-sized MoE base",
    ),
    "llama3_builders": Upstream(
        "torchtitan.models.llama3:_build_llama3_layers",
        69,
        "57d8388f72a1db30",
        "torchtitan's llama3 block builder (and its _output_linear_init, line 54), for the narrow debug base",
    ),
    "dtensor_local_tensor": Upstream(
        "torch.distributed.tensor._api:DTensor",
        0,
        "",  # an attribute set in DTensor.__new__ (no source of its own): tests/titan/targets/test_quantize_train.py's
        # torchao fp8 all-gather run depends on it
        "a DTensor's ``_local_tensor`` as it is (``to_local()`` is an autograd view): torchao's fp8 weight wrapper",
    ),
    "fsdp_all_gather": Upstream(
        "torch.distributed.fsdp._fully_shard._fsdp_api:AllGather",
        100,
        "d24a59aa0bc6513d",
        "the base of a custom all-gather (FSDPModule.set_custom_all_gather): the low-bit wire",
    ),
    "fsdp_reduce_scatter": Upstream(
        "torch.distributed.fsdp._fully_shard._fsdp_api:ReduceScatter",
        115,
        "196072d26f7ebf02",
        "the base of a custom reduce-scatter (FSDPModule.set_custom_reduce_scatter): the low-bit wire",
    ),
    "fsdp_state": Upstream(
        "torch.distributed.fsdp._fully_shard._fully_shard:FSDPModule._get_fsdp_state",
        881,
        "f2c8b4bf8e8454ad",
        "an FSDP2 unit's parameter groups (``_fsdp_param_groups``): which parameters share one collective",
    ),
    "fsdp_post_backward": Upstream(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.post_backward",
        606,
        "65e3fef1ac265f4c",
        "a reduce-scatter sends, in the unit's order, only the parameters that got a gradient",
    ),
    "fsdp_sharded_param": Upstream(
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._init_sharded_param",
        248,
        "c8322a9d55427065",
        "``_sharded_param_data`` (the padded fp32 shard, flat) and ``_sharded_local_tensor`` (torchao's "
        "Float8 weight wrapper, if any) of a parameter",
    ),
    "fake_tensor_mode": Upstream(
        "torch._subclasses.fake_tensor:FakeTensorMode",
        1528,
        "5627e26e06de039c",
        "tensors with shapes and no memory, on which the memory planner runs two training steps",
    ),
    "fake_data_dependent": Upstream(
        "torch._subclasses.fake_tensor:DataDependentOutputException",
        175,
        "d9a29f73163b66b7",
        "what an op raises on fake tensors when it needs their values (the planner stands the states in)",
    ),
    "fake_dynamic_shape": Upstream(
        "torch._subclasses.fake_tensor:DynamicOutputShapeException",
        170,
        "537506322e2eda86",
        "what an op raises on fake tensors when its output shape depends on values",
    ),
    "fake_unsupported": Upstream(
        "torch._subclasses.fake_tensor:UnsupportedFakeTensorException",
        149,
        "357f373e1ee194f7",
        "what an op raises that has no fake implementation",
    ),
    "forget_shardings": Upstream(
        "torch.distributed.tensor.debug:_clear_sharding_prop_cache",
        50,
        "7a60c54245289ac9",
        "DTensor's sharding-propagation caches (Python and C++), keyed by mesh equality: the planner empties them "
        "around each plan, whose meshes equal an earlier plan's of the same size without being the same objects",
    ),
    "fake_process_group": Upstream(
        "torch.testing._internal.distributed.fake_pg:_create_fake_pg",
        14,
        "d9f25be8ef84737a",
        "torch's fake backend (registered when its module is imported): collectives that return at once with "
        "tensors of the right shapes, for the memory planner",
    ),
    "forward_backward_body": Upstream(
        "torchtitan.trainer:Trainer._forward_backward_body",
        806,
        "2d88c5250155b17d",
        "torchtitan's own forward, loss and backward of one microbatch, run by the memory planner on a stand-in",
    ),
    "aot_autograd": Upstream(
        "torch._dynamo.backends.common:aot_autograd",
        164,
        "b452e0e843b79e9c",
        "a dynamo backend from forward and backward compilers: the planner's stand-in for inductor",
    ),
    "inductor_decompositions": Upstream(
        "torch._inductor.compile_fx:select_decomp_table",
        1169,
        "2180869657eab772",
        "the decompositions inductor traces with, so the planner partitions the graphs inductor partitions",
    ),
    "titan_compile_backend": Upstream(
        "torchtitan.distributed.compile:_maybe_regional_inductor_backend",
        99,
        "36845d1a1bd49b69",
        "the backend torchtitan's apply_compile hands to torch.compile: the planner swaps in its own for the "
        "build (torchtitan otherwise refuses any backend but inductor's and aot_eager for FlexAttention models)",
    ),
    "inductor_compile_threads": Upstream(
        "torch._inductor.config:_config",
        0,
        "",  # a setting: tests/titan/platform/test_compat.py checks the key and what it does
        "how many threads inductor compiles with; 1 compiles in the calling process (the planner's forked child)",
    ),
    "inductor_partition": Upstream(
        "torch._dynamo.backends.debugging:aot_eager_decomp_partition",
        448,
        "e96804c2681a9ad5",
        "torch's own recipe for inductor's forward / backward split without inductor (decompositions, min-cut "
        "partitioner for compiler 'inductor', effect tokens unlifted), which partitioned_backend follows",
    ),
    "inductor_code": Upstream(
        "torch._inductor.compile_fx:compile_fx_inner",
        857,
        "117ce5e08c3a3582",
        "inductor's compile of one partitioned graph: the planner reads the buffers its generated code allocates",
    ),
    "inductor_code_text": Upstream(
        "torch._inductor.output_code:CompiledFxGraph",
        515,
        "811aa4c7ba3110b0",
        "what inductor's compile returns: its ``source_code`` is the generated Python wrapper",
    ),
    "no_dispatch_modes": Upstream(
        "torch.utils._python_dispatch:_disable_current_modes",
        390,
        "bdb1a45e8729c18d",
        "inductor compiles with none of the planner's modes (its fake mode, its count) on the stack",
    ),
    **RECORDS,  # the private torch names of the floors below titan (low_bits_training/upstream.py)
}


def resolve(target: str) -> Any:
    """The object ``module:qualname`` names."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def source_digest(obj: Any) -> tuple[int, str]:
    """``(first line, first 16 hex digits of the sha256 of its source)`` of a function or class.

    Returns:
        ``(0, "")`` for objects without source (module-level flags).
    """
    try:
        lines, first = inspect.getsourcelines(obj)
    except TypeError:
        return 0, ""
    return first, hashlib.sha256("".join(lines).encode()).hexdigest()[:16]


# --- torchtitan.config.manager ------------------------------------------------------------------------------


@functools.cache
def config_manager():
    """torchtitan's ConfigManager (made once: it registers torchtitan's tyro rules)."""
    from torchtitan.config.manager import ConfigManager

    return ConfigManager()


def config_function(module: str, fn: str) -> Any:
    """Call config function ``fn`` of ``module`` as ``--module module --config fn`` would.

    Upstream: config/manager.py ``ConfigManager._load_config`` (line 48) resolves torchtitan's short model
    names (``llama3``) and dotted modules alike, and has no public form.

    Raises:
        ValueError, ImportError, TypeError: as upstream raises them (unknown module or function, arguments).
    """
    cfg, _ = config_manager()._load_config(["--module", module, "--config", fn])
    return cfg


# --- torchtitan.components.metrics --------------------------------------------------------------------------


def metrics_rank(parallel_dims: Any, pp_schedule: str) -> int:
    """The rank torchtitan logs metrics from (components/metrics.py ``_get_metrics_rank``, line 232)."""
    from torchtitan.components.metrics import _get_metrics_rank

    return _get_metrics_rank(parallel_dims=parallel_dims, pp_schedule=pp_schedule)


class MetricLoggerHook:
    """Mixin before ``MetricsProcessor``: ``wrap_metric_logger`` sees the logger upstream built.

    Upstream: components/metrics.py ``MetricsProcessor._build_metric_logger`` (line 365), called once from
    ``__init__`` with keyword arguments only.
    """

    def _build_metric_logger(self, **kwargs: Any) -> Any:
        return self.wrap_metric_logger(super()._build_metric_logger(**kwargs), **kwargs)

    def wrap_metric_logger(self, inner: Any, **kwargs: Any) -> Any:
        """Return the logger to use instead of ``inner`` (default: ``inner``)."""
        return inner


# --- torchtitan.components.checkpointer.dcp -----------------------------------------------------------------


class CheckpointHooks:
    """Mixin before ``CheckpointManager``: ``after_save`` / ``before_load`` / ``after_load`` around upstream.

    Upstream: checkpointer/base.py says subclasses override ``_save`` / ``_load`` (dcp.py lines 379 / 474),
    the hooks its public ``save`` / ``load`` call only when checkpointing is on.
    """

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        if saved:
            self.after_save(curr_step)
        return saved

    def _load(self, step: int = -1) -> bool:
        try:
            self.before_load(step)
            loaded = super()._load(step)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            raise self.load_error(e) from e
        self.after_load(loaded)
        return loaded

    def after_save(self, step: int) -> None:
        """Called after a save of ``step`` returned."""

    def before_load(self, step: int) -> None:
        """Called before upstream loads ``step`` (-1: the latest)."""

    def after_load(self, loaded: bool) -> None:
        """Called after upstream's load returned (``loaded``: a checkpoint was read)."""

    def load_error(self, error: BaseException) -> BaseException:
        """The exception to raise instead of ``error`` from ``before_load`` or upstream's load."""
        return error


def find_load_step(folder: str) -> int:
    """The step a run with checkpoint folder ``folder`` resumes from (-1: none), as torchtitan picks it.

    Upstream: checkpointer/dcp.py ``CheckpointManager._find_load_step`` (line 640): the highest ``step-N``
    holding ``.metadata`` (or an HF index). It reads ``self`` only when no folder is given.
    """
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    return CheckpointManager._find_load_step(None, folder)  # type: ignore[arg-type]


def checkpoint_path(folder: str, step: int) -> str:
    """The folder of checkpoint ``step`` (checkpointer/dcp.py ``_create_checkpoint_id``, line 686)."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    return CheckpointManager._create_checkpoint_id(None, step, folder)  # type: ignore[arg-type]


# --- torch.autograd.profiler --------------------------------------------------------------------------------


def profiler_running() -> bool:
    """True while a torch profiler records (torch/autograd/profiler.py ``_is_profiler_enabled``)."""
    import torch

    return bool(torch.autograd.profiler._is_profiler_enabled)


def memory_categories() -> tuple[str, ...]:
    """Names of the memory categories in the order ``export_memory_timeline``'s JSON holds them (after a
    leading 0 column): torch/profiler/_memory_profiler.py ``_CATEGORY_TO_COLORS`` (line 47)."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_COLORS

    return tuple("unknown" if c is None else c.name.lower() for c in _CATEGORY_TO_COLORS)


# --- torch.distributed.fsdp._fully_shard (FSDP2's custom-collective hooks) ------------------------------------


def fsdp_collective_bases() -> tuple[type, type]:
    """FSDP2's ``AllGather`` and ``ReduceScatter`` bases (``_fsdp_api.py`` lines 100 / 115): torch 2.14 has
    the hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) but no public home for the bases."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def fsdp_param_groups(module: Any) -> list:
    """The parameter groups of an FSDP2 unit (``FSDPModule._get_fsdp_state()._fsdp_param_groups``, line
    881): each group's parameters share one all-gather and one reduce-scatter."""
    return list(module._get_fsdp_state()._fsdp_param_groups)


def fsdp_sharded_data(fsdp_param: Any) -> Any:
    """A parameter's padded shard in its own dtype, flat (``FSDPParam._sharded_param_data``, set in
    ``_init_sharded_param``, line 248): what FSDP2 casts to its param dtype for the all-gather."""
    return fsdp_param._sharded_param_data


def fsdp_sharded_local(fsdp_param: Any) -> Any:
    """A parameter's local shard tensor (``FSDPParam._sharded_local_tensor``): torchao's Float8 weight
    wrapper carries ``fsdp_pre_all_gather`` there."""
    return fsdp_param._sharded_local_tensor


# --- torch._inductor.config -----------------------------------------------------------------------------------


def inductor_as_eager() -> tuple[str, ...]:
    """Turn on ``INDUCTOR_AS_EAGER`` (``upstream``; process-wide; read at each compile).

    Returns:
        The switches this torch does not have (older torch: the check of the GPU runs it on torch 2.11 too).
    """
    import torch._inductor.config as inductor

    here = inductor_as_eager_here()
    for name in here:
        setattr(inductor, name, True)
    return tuple(name for name in INDUCTOR_AS_EAGER if name not in here)


def compile_in_this_process() -> None:
    """Inductor compiles in this process from here on, no worker pool (``compile_threads = 1``; process-wide).

    For a forked child (the planner's, ``titan/runtime/peak_fit.in_child``): a parent that compiled already
    holds inductor's pool (``AsyncCompile.pool``, made once), whose threads a fork does not copy; the child's
    first compile would wait on them for ever.
    """
    import torch._inductor.config as inductor

    inductor.compile_threads = 1


# --- torchao.float8._inductor_patch ---------------------------------------------------------------------------


def guard_fp8_stores() -> None:
    """Apply torchao's workaround for Triton's fp8-store miscompile (triton-lang/triton#11111: inductor's
    ``tl.minimum/maximum(..., PropagateNan.ALL)`` codegen makes Triton write garbage bytes, read back as
    NaN/Inf, in a neighbouring transposed 1-byte store; torchao saw it in compiled FSDP2 float8 runs).

    Upstream: torchao/float8/_inductor_patch.py ``_patch_inductor_min_max_codegen`` (line 42), called only
    from ``convert_to_float8_training`` (float8_linear_utils.py); torchtitan's config classes and ours build
    torchao's modules without it. It swaps inductor's Triton min/max codegen for the ``tl.where`` form:
    the same values (NaN propagates alike), process-wide, idempotent; no effect on CPU code (C++ codegen).
    """
    from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen

    _patch_inductor_min_max_codegen()


def fp8_stores_guarded() -> bool:
    """True when inductor's Triton ``maximum`` / ``minimum`` emit the ``tl.where`` form (``guard_fp8_stores``
    applied, or inductor itself back on that form)."""
    from torch._inductor.codegen.triton import TritonOverrides

    return all(f("a", "b").startswith("tl.where") for f in (TritonOverrides.maximum, TritonOverrides.minimum))


# --- torchtitan's MoE pieces -------------------------------------------------------------------------------


def grouped_experts_class(kind: str, experts_cls: type) -> type:
    """torchtitan's torchao experts class for ``experts_cls``: ``kind`` "float8" (components/quantization/
    float8.py ``_get_float8_grouped_experts_cls``, line 179) or "mxfp8" (mx.py ``_get_mxfp8_grouped_experts_cls``,
    line 104), the classes its MoE converters build."""
    if kind == "float8":
        from torchtitan.components.quantization.float8 import _get_float8_grouped_experts_cls as get
    else:
        from torchtitan.components.quantization.mx import _get_mxfp8_grouped_experts_cls as get
    return get(experts_cls)


def config_owner(config_cls: type) -> type | None:
    """The module class a nested ``Config`` class builds (``_owner``, set by ``Configurable.__init_subclass__``,
    line 162), or None."""
    return getattr(config_cls, "_owner", None)


def torchao_config_of(linear_config: Any) -> Any:
    """torchao's config carried by a torchtitan float8 linear config (its ``_torchao_config`` field), or None."""
    return getattr(linear_config, "_torchao_config", None)


def qwen3_builders() -> tuple[Any, Any, Any, Any]:
    """torchtitan's Qwen3 builders (models/qwen3/__init__.py): ``(embedding init, linear init, MoE layers
    builder, norm builder)``, private there (``_EMBEDDING_INIT`` ... ``_build_qwen3_moe_layers`` line 134)."""
    from torchtitan.models import qwen3

    return qwen3._EMBEDDING_INIT, qwen3._LINEAR_INIT, qwen3._build_qwen3_moe_layers, qwen3._qwen3_norm


def llama3_builders() -> tuple[Any, Any]:
    """torchtitan's llama3 builders (models/llama3/__init__.py, private there): ``(layers builder
    _build_llama3_layers line 69, output init _output_linear_init line 54)``."""
    from torchtitan.models import llama3

    return llama3._build_llama3_layers, llama3._output_linear_init


def dtensor_local_tensor(t: Any) -> Any:
    """A DTensor's local tensor object itself (``DTensor._local_tensor``; ``to_local()`` returns an autograd
    view, which hides torchao's fp8 weight wrapper class)."""
    return t._local_tensor


# --- fake tensors and a fake process group: the memory planner (titan/runtime/peak.py) -----------------------


def fake_process_group(world_size: int) -> None:
    """Rank 0 of a process group of ``world_size`` on torch's fake backend (``fake_process_group``)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg  # registers the "fake" backend

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=world_size)


def forget_shardings() -> None:
    """Empty DTensor's sharding-propagation caches, Python's and the C++ fast path's (``forget_shardings``).

    Their keys compare meshes by value. Two plans of one size in one process build equal meshes that are not the
    same objects; a cached result of the first plan hands its mesh to the second, and FSDP2 refuses a parameter
    whose mesh is not the very one passed to ``fully_shard`` ("Expected param's DTensor mesh to be the same
    mesh passed to fully_shard, but got different mesh objects").
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` that also takes real tensors as inputs (``fake_tensor_mode``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_refusals() -> tuple[type, ...]:
    """What ops raise on fake tensors when they need values or have no fake kernel (``fake_data_dependent``,
    ``fake_dynamic_shape``, ``fake_unsupported``)."""
    from torch._subclasses import fake_tensor as ft

    return ft.DataDependentOutputException, ft.DynamicOutputShapeException, ft.UnsupportedFakeTensorException


def forward_backward_body(trainer: Any, *args: Any) -> Any:
    """torchtitan's forward, loss and backward of one microbatch on ``trainer`` (``forward_backward_body``)."""
    from torchtitan.trainer import Trainer

    return Trainer._forward_backward_body(trainer, *args)


def partitioned_backend(run: Callable[[Any, list, bool], Callable[[list], Any]]) -> Callable:
    """A dynamo backend that splits a graph into forward and backward as inductor does, and runs each through
    ``run(graph_module, example_inputs, is_backward)`` instead of inductor's code: ``run`` returns a function of
    the list of the graph's inputs, which it may empty as it goes (boxed, as inductor's code frees the saved
    activations it has read).

    Upstream: ``torch._dynamo.backends.debugging.aot_eager_decomp_partition`` (line 448) is this recipe with a
    compiler that runs the graph as it is: ``aot_autograd`` (backends/common.py line 164) with inductor's
    decompositions (``select_decomp_table``, compile_fx.py line 1169) and the min-cut partitioner for
    ``compiler="inductor"``, effect tokens unlifted.
    """
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import select_decomp_table

    def boxed(is_backward: bool, gm: Any, example_inputs: list) -> Callable[[list], Any]:
        fn = run(gm, example_inputs, is_backward)
        fn._boxed_call = True
        return fn

    def backend(gm: Any, example_inputs: list) -> Any:
        with functorch_config.patch({"unlift_effect_tokens": True}):
            return aot_autograd(
                fw_compiler=functools.partial(boxed, False),
                bw_compiler=functools.partial(boxed, True),
                decompositions=select_decomp_table,
                partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
            )(gm, example_inputs)

    return backend


def inductor_code(gm: Any, example_inputs: list, is_backward: bool) -> str:
    """The Python code inductor generates for one partitioned graph ``gm`` (forward or backward): its
    buffers' allocations and frees as the compiled graph makes them. Compiled for the device of
    ``example_inputs`` (fake tensors are fine) on a copy of ``gm`` (inductor's passes change the graph they
    get), with no dispatch mode of the caller's on the stack.

    Upstream: ``torch._inductor.compile_fx.compile_fx_inner`` (line 857) returns a ``CompiledFxGraph``
    (output_code.py line 515) whose ``source_code`` is that code; ``_disable_current_modes``
    (utils/_python_dispatch.py line 390).
    """
    import torch.fx
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.utils._python_dispatch import _disable_current_modes

    graph = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    with _disable_current_modes():
        return compile_fx_inner(graph, list(example_inputs), is_backward=is_backward).source_code


@contextlib.contextmanager
def titan_compile_backend(backend: Callable):
    """While open, torchtitan's ``apply_compile`` (distributed/compile.py line 39, which every model's
    ``parallelize_fn`` calls) compiles with ``backend``: it asks ``_maybe_regional_inductor_backend`` (line 99)
    for the backend, which would refuse one of ours on a model with FlexAttention."""
    from torchtitan.distributed import compile as titan_compile

    before = titan_compile._maybe_regional_inductor_backend
    titan_compile._maybe_regional_inductor_backend = lambda model, name: backend
    try:
        yield
    finally:
        titan_compile._maybe_regional_inductor_backend = before
