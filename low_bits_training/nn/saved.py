"""Saved activations in a low-bit format: autograd's saved-tensor hooks around chosen modules.

While a chosen module runs its forward, every tensor autograd saves for the backward passes through
``pack``: a floating activation of at least ``min_numel`` elements is stored by the module's codec as codes
+ scales or as a plain bf16 / fp16 copy (``ReferenceCodec``: ``formats.quantize``; the run uses
``titan.targets.saved.SaveCodec``, equal to it bit for bit), and the backward reads back the decoded values in
the tensor's own dtype and layout. Parameters and their views (a linear's ``W^T``), the
softmax statistics of attention (``SaveFormat.keep_tails``), integer and 1-byte tensors (a quantized
layer's own codes) and small tensors are kept as they are. A tensor saved twice in one forward (a SwiGLU
input that both w1 and w3 save) is packed once (also when two modules save it: the mask every block is given).

The hooks wrap the module's ``__call__`` (its class is swapped for a subclass, so FQNs, state dicts and
FSDP2 are untouched), outside any ``torch.compile`` of the module: with a compiled transformer block the
hooks see the values the compiled graph saves. Under activation checkpointing the checkpoint's own hooks
are the inner ones: a checkpointed region keeps its input through ours and recomputes the rest (what
selective AC keeps passes through ours too once its checkpoint respects outer hooks:
``titan.targets.saved.pack_selective_saves``).

``BYTES`` counts, per module, what was saved since the last ``take_bytes``: elements, bytes as the forward
made them (a storage once, however many views of it are saved), bytes stored (a tensor kept as made: its
storage, once). ``METER`` (set for one step by ``titan.targets.saved``) measures each
module's call with the allocator (``optim.memory.HeldBytes``: ``span`` and ``output``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from low_bits_training.formats import QuantizedTensor, QuantSpec, dequantize, quantize

CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ReferenceCodec:
    """How a save is stored, written with ``formats.quantize`` / ``dequantize`` (codes + fp32 scales) or a
    plain cast: the reference any faster codec (``titan.targets.saved.SaveCodec``) is held to."""

    def __init__(self, spec: QuantSpec | None = None, cast: str | None = None):
        self.spec, self.cast = spec, cast

    def fits(self, t: torch.Tensor) -> bool:
        if self.cast is not None:
            return t.element_size() > CAST_DTYPES[self.cast].itemsize
        spec = self.spec
        return spec is not None and (spec.scaling != "block" or t.shape[-1] % spec.block_size == 0)

    def encode(self, t: torch.Tensor):
        if self.cast is not None:
            return (t.to(CAST_DTYPES[self.cast]), t.dtype)
        return quantize(t, self.spec)

    @staticmethod
    def decode(packed) -> torch.Tensor:
        if isinstance(packed, QuantizedTensor):
            return dequantize(packed)
        return packed[0].to(packed[1])

    @staticmethod
    def nbytes(packed) -> int:
        if isinstance(packed, QuantizedTensor):
            extra = packed.tensor_scale.nbytes if packed.tensor_scale is not None else 0
            return packed.codes.nbytes + packed.scales.nbytes + extra
        return packed[0].nbytes


@dataclass(frozen=True)
class SaveFormat:
    """How one module's saves are stored: ``codec`` (``ReferenceCodec``'s methods; None: as made) for
    floating tensors of at least ``min_numel`` elements."""

    codec: object | None = None
    min_numel: int = 4096
    keep_tails: tuple[tuple[int, ...], ...] = ()
    """Trailing shapes of tensors kept as made: the softmax statistics of attention, ``(heads, seq_len)``
    (the logsumexp the backward recomputes the probabilities from: a low-bit copy would skew every one)."""


BYTES: dict[str, list[int]] = {}
"""module FQN -> [elements, bytes as made, bytes stored] of the saves packed since ``take_bytes``."""

METER = None
"""While set: an object with ``span(fqn)`` (a context manager around each hooked module's call) and
``output(fqn, out)`` (what the call returned), as ``optim.memory.HeldBytes`` has."""

_STORAGES: dict[int, weakref.ref] = {}
"""storage address -> a saved tensor of that storage since ``take_bytes`` (a view's base: it lives while any
view of it does): while it lives the address is that storage (counted once); once it is gone the address may be
another's (counted again)."""


def take_bytes() -> dict[str, list[int]]:
    """The counts since the last call (and reset them)."""
    out = {k: list(v) for k, v in BYTES.items() if v[0]}
    BYTES.clear()
    _STORAGES.clear()
    return out


def _made_bytes(t: torch.Tensor) -> int:
    """The bytes a save adds as the forward made it: its storage's, the first time the storage is seen (the
    views autograd saves of one tensor hold one storage)."""
    storage = t.untyped_storage()
    seen = _STORAGES.get(storage.data_ptr())
    if seen is not None and seen() is not None:
        return 0
    _STORAGES[storage.data_ptr()] = weakref.ref(t if t._base is None else t._base)  # alive while a view is
    return storage.nbytes()


class _Packed:
    """A stored save and the codec that reads it back."""

    __slots__ = ("__weakref__", "codec", "stride", "value")

    def __init__(self, codec, value, stride):
        self.codec, self.value, self.stride = codec, value, stride

    def unpack(self) -> torch.Tensor:
        y = self.codec.decode(self.value)
        if self.stride is None:
            return y
        out = torch.empty_strided(y.shape, self.stride, dtype=y.dtype, device=y.device)
        return out.copy_(y)  # the layout the forward made: a compiled backward asserts strides


def _dense(t: torch.Tensor) -> bool:
    """Every element at its own address, none skipped (contiguous up to a permutation of the dims)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


_SEEN: dict[int, tuple] = {}
"""id(tensor) -> (weak tensor, weak packed save): a tensor saved again while both live is
packed once. Weak both ways (identity, not address: a freed tensor's address is reused), so the cache holds
nothing the backward has released."""


def _remember(t: torch.Tensor, packed) -> None:
    if len(_SEEN) > 4096:
        for k in [k for k, v in _SEEN.items() if v[0]() is None or v[1]() is None]:
            del _SEEN[k]
    _SEEN[id(t)] = (weakref.ref(t), weakref.ref(packed))


_VIEWS = (
    "TBackward",
    "ToCopyBackward",
    "ViewBackward",
    "TransposeBackward",
    "PermuteBackward",
    "ExpandBackward",
    "UnsafeViewBackward",
    "AliasBackward",
    "SliceBackward",
    "SelectBackward",
)
"""Autograd nodes of a view or a copy: a weight reached through them is still the weight."""


def held(t: torch.Tensor) -> bool:
    """A parameter (or another leaf that requires grad), or a view / cast of one a few ops away (a linear's
    ``W^T``, a bf16 cast of W): held by its owner, not an activation."""
    if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    fn = t.grad_fn
    for _ in range(4):
        if fn is None or not type(fn).__name__.startswith(_VIEWS):
            return fn is not None and type(fn).__name__ == "AccumulateGrad"
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


class SavedHooks:
    """The pack / unpack pair of one module; ``scope()`` makes them autograd's for the module's forward."""

    def __init__(self, fqn: str, fmt: SaveFormat):
        self.fqn, self.fmt = fqn, fmt

    def _keep(self, t: torch.Tensor) -> bool:
        fmt = self.fmt
        return (
            fmt.codec is None
            or not t.is_floating_point()
            or t.element_size() <= 1
            or t.dim() == 0
            or t.numel() < fmt.min_numel
            or any(tuple(t.shape[-len(tail) :]) == tail for tail in fmt.keep_tails)
            or not fmt.codec.fits(t)
            or not _dense(t)
        )

    def pack(self, t: torch.Tensor):
        if held(t):
            return t  # not an activation: not counted either
        hit = _SEEN.get(id(t))
        # the same tensor saved again, here or by another module (a mask every block gets): packed once
        if hit is not None and hit[0]() is t and hit[1]() is not None:
            return hit[1]()
        made = _made_bytes(t)
        if self._keep(t):
            packed, stored = t, made
        else:
            with torch.no_grad():
                codec = self.fmt.codec
                packed = _Packed(codec, codec.encode(t.detach()), None if t.is_contiguous() else t.stride())
                stored = codec.nbytes(packed.value)
        count = BYTES.setdefault(self.fqn, [0, 0, 0])
        count[0] += t.numel()
        count[1] += made
        count[2] += stored
        _remember(t, packed)
        return packed

    @staticmethod
    def unpack(packed) -> torch.Tensor:
        return packed.unpack() if isinstance(packed, _Packed) else packed

    @contextlib.contextmanager
    def scope(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


_CLASSES: dict[type, type] = {}


def _saving_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that runs the module's call (hooks, compiled forward) inside its scope."""
    if cls not in _CLASSES:

        def __call__(self, *args, **kwargs):
            meter, fqn = METER, self.lbt_saved.fqn
            if meter is None:
                with self.lbt_saved.scope():
                    return super(sub, self).__call__(*args, **kwargs)
            with meter.span(fqn), self.lbt_saved.scope():
                out = super(sub, self).__call__(*args, **kwargs)
            meter.output(fqn, out)
            return out

        sub = type(f"Saved{cls.__name__}", (cls,), {"__call__": __call__, "lbt_saving": True})
        _CLASSES[cls] = sub
    return _CLASSES[cls]


def install(module: torch.nn.Module, fqn: str, fmt: SaveFormat) -> None:
    """Keep ``module``'s saves in ``fmt`` from now on (idempotent: a second call changes the format)."""
    module.lbt_saved = SavedHooks(fqn, fmt)
    if not getattr(type(module), "lbt_saving", False):
        module.__class__ = _saving_class(type(module))
