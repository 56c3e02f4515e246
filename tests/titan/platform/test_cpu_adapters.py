"""The four CPU adapters: each still needed upstream (the test fails when upstream fixes the problem, so the
adapter can go) and each working."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from helpers import REPO
from low_bits_training.titan.platform import cpu

pytestmark = pytest.mark.skipif(
    not cpu.needs_cpu_adapters(), reason="adapters apply only without an accelerator"
)


def _py(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1]


def test_upstream_still_says_cuda_without_an_accelerator():
    # torchtitan/tools/utils.py ~55: `_get_available_device_type() or "cuda"`. When this prints "cpu", drop adapter 1.
    assert _py("import torchtitan.tools.utils as u; print(u.device_type)") == "cuda"


def test_device_adapter_reaches_the_modules_that_copy_device_type():
    code = (
        "from low_bits_training.titan.platform import cpu; cpu.install_device_module()\n"
        "import torchtitan.components.metrics as m, torchtitan.distributed.utils as d\n"
        "mon = m.DeviceMemoryMonitor(); s = mon.get_peak_stats()\n"
        "print(m.device_type, d.device_type, mon.device_name, s.max_reserved_gib > 0.01)"
    )
    assert _py(code) == "cpu cpu cpu True"


def test_device_adapter_refuses_to_apply_too_late():
    # Importing titan puts the adapter in (titan/platform/stand.py); after a torchtitan module that copied
    # device_type = "cuda", that import is refused with the module's name rather than train on a wrong device.
    code = (
        "import torchtitan.components.metrics\n"
        "try:\n    import low_bits_training.titan.launch.worker\nexcept RuntimeError as e:\n"
        "    print('refused', 'metrics' in str(e))"
    )
    assert _py(code) == "refused True"


def test_importing_titan_points_torchtitan_at_the_cpu_before_its_first_module():
    code = (
        "import sys\nimport low_bits_training.titan.platform.devices\n"
        "import torchtitan.components.metrics as m\nprint(m.device_type, 'torchtitan.trainer' in sys.modules)"
    )
    assert _py(code) == "cpu False"


def _qkv(B=2, L=64, N=4, H=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, L, N, H, generator=g, requires_grad=True) for _ in range(3)]  # (B, L, N, H)


def _document_mask(B, L):
    # Two documents per row, boundaries at different places: the block-causal mask torchtitan builds.
    doc = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        doc[b, (L // 3) * (b + 1) :] = 1

    def mask_mod(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    return create_block_mask(mask_mod, B, None, L, L, device="cpu")


def test_upstream_flex_attention_still_has_no_cpu_backward():
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with pytest.raises(
        NotImplementedError, match="backward on CPU"
    ):  # when this stops raising, adapter 2 can go
        flex_attention(q, k, v, block_mask=_document_mask(2, 64)).sum().backward()


def test_dense_mask_attention_matches_flex_forward_and_has_a_backward():
    from torchtitan.models.common.attention import FlexAttention

    attn_cls = cpu._dense_attention_class()
    q, k, v = _qkv()
    mask = _document_mask(2, 64)
    ours = attn_cls(attn_cls.Config())(q, k, v, attention_masks=mask)
    with torch.no_grad():
        ref = flex_attention(*(t.detach().transpose(1, 2) for t in (q, k, v)), block_mask=mask).transpose(
            1, 2
        )
    torch.testing.assert_close(ours, ref, atol=2e-6, rtol=1e-5)
    ours.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    assert issubclass(attn_cls, FlexAttention)


def test_attention_configs_are_swapped_in_the_model_tree():
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    assert cpu.use_dense_mask_attention(spec.model) == 6  # one per layer
    kinds = {type(c).__qualname__ for _, c, _, _ in spec.model.traverse(FlexAttention.Config)}
    assert kinds == {"_dense_attention_class.<locals>.DenseMaskAttention.Config"}
    assert cpu.use_dense_mask_attention(spec.model) == 0  # idempotent


def test_upstream_still_compiles_the_mask_and_the_eager_mask_is_the_same():
    # Adapter 4: torchtitan's decoder calls a torch.compile'd create_block_mask each step; the adapter makes it the
    # eager one. When the first assert fails (upstream stopped compiling it), the adapter can go.
    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import and_masks

    code = (
        "import torchtitan.models.common.attention as a, torchtitan.models.common.decoder as d\n"
        "print(d.create_attention_mask is a.create_attention_mask, 'torch.compile' in a.create_attention_mask.__doc__"
        " or 'compiled' in a.create_attention_mask.__doc__)"
    )
    assert _py(code) == "True True"
    positions = torch.cat([torch.arange(40), torch.arange(88)]).expand(2, 128)  # two documents per row
    mod = and_masks(attention.get_causal_mask_mod(), attention.get_document_mask_mod(positions))
    upstream = attention.create_attention_mask(mod, 2, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    cpu.build_masks_eagerly()
    import torchtitan.models.common.decoder as decoder

    assert decoder.create_attention_mask is create_block_mask
    ours = decoder.create_attention_mask(mod, 2, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(ours, name), getattr(upstream, name)), name
    assert ours.mask_mod is mod and ours.shape == upstream.shape


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_upstream_gloo_still_refuses_premul_sum(gloo_group):
    # torchtitan sets FSDP2's divide factor to 1.0 -> PREMUL_SUM. When gloo accepts it, drop adapter 3.
    op = dist._make_nccl_premul_sum(1.0)
    with pytest.raises((RuntimeError, ValueError)):
        dist.all_reduce(torch.ones(4), op=op)


def test_sum_reduction_adapter_marks_every_fsdp_module(gloo_group):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    ref = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(2)))
    ref.load_state_dict(model.state_dict())
    for m in model:
        fully_shard(m)
        m.set_gradient_divide_factor(1.0)  # what torchtitan does (distributed/fsdp.py)
    model = cpu.with_sum_reductions(lambda m: m)(model)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model]
    assert all(g.force_sum_reduction_for_comms for g in groups)
    x = torch.randn(3, 4)
    model(x).sum().backward()  # the reduce-scatter runs on gloo with SUM
    ref(x).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=0, atol=0)
