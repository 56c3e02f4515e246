"""The attention products in the precision plan: which rules reach them, and what their shapes refuse.

Every attention module the plan covers adds two entries beside the linear layers, ``<attention fqn>.qk``
(``S = Q K^T``) and ``<attention fqn>.pv`` (``O = P V``), each with the six roles of a linear layer
(``nn.attention`` has the GEMM table). They start in high precision whatever the recipe, so a plan that
does not name them leaves attention exactly as it was. A rule reaches them only through a ``layers`` glob
that matches attention products and no linear layer (``layers.*.attention.qk``, ``*.pv``,
``*.attention.[qp][kv]``); globs that match linear layers, rules without ``layers``, ``first_n`` and
``last_n`` keep meaning linear layers. ``skip`` globs put the products they match back in high precision.

As a linear layer each product has a shape (``plan.resolve.LayerShape``, ``product`` set): qk has in_features
= head_dim, out_features = seq_len (keys); pv has in_features = seq_len, out_features = head_dim; the token
count is the sequence length of the queries.
"""

from __future__ import annotations

import fnmatch

from low_bits_training.errors import ConfigError
from low_bits_training.nn import ROLES

OPERANDS: dict[str, dict[str, tuple[str, tuple[str, str]]]] = {
    "qk": {
        "input": ("Q", ("seq_len", "head_dim")),
        "weight": ("K", ("seq_len", "head_dim")),
        "grad_output": ("dS", ("seq_len", "seq_len")),
    },
    "pv": {
        "input": ("P", ("seq_len", "seq_len")),
        "weight": ("V^T", ("head_dim", "seq_len")),
        "grad_output": ("dO", ("seq_len", "head_dim")),
    },
}
"""Per product and operand: the attention tensor it is, and the names of its two dims (per batch and head)."""


def named_products(globs: list[str], fqns: list[str], products: set[str]) -> list[str]:
    """The attention products (among ``fqns``) that ``globs`` name: matched by a glob that matches no
    linear layer (see the module doc)."""
    linears = [f for f in fqns if f not in products]
    named = [g for g in globs if not fnmatch.filter(linears, g)]
    return [f for f in fqns if f in products and any(fnmatch.fnmatchcase(f, g) for g in named)]


def _operand_dims(shape, operand: str) -> tuple[int, int]:
    m, n, k = shape.tokens_multiple, shape.out_features, shape.in_features
    return {"input": (m, k), "weight": (n, k), "grad_output": (m, n)}[operand]


def contraction(shape, gemm: str) -> tuple[str, int]:
    """(name, size) of the contraction dim of one GEMM of an attention product (``head_dim`` / ``seq_len``)."""
    operand, axis = {"forward": ("input", -1), "dgrad": ("grad_output", -1), "wgrad": ("input", 0)}[gemm]
    return OPERANDS[shape.product][operand][1][axis], _operand_dims(shape, operand)[axis]


def check_product_shapes(specs: tuple, fqn: str, shape, where_of) -> None:
    """Block and tile sizes of an attention product against its head_dim and sequence length.

    Args:
        specs: the product's role specs (``ROLES`` order).
        fqn: the product (``layers.0.attention.qk``).
        shape: its ``LayerShape`` (``product`` set).
        where_of: role name -> the TOML key of the rule that set its spec (``quantize.rules[0]``).

    Raises:
        ConfigError: ``<rule key>: <fqn> <role>: block_size = 48 does not divide head_dim = 64 (K, blocked
            along head_dim in the forward GEMM)``.
    """
    for role, spec in zip(ROLES, specs, strict=True):
        if spec is None or spec.scaling not in ("block", "tile"):
            continue
        tensor, names = OPERANDS[shape.product][role.operand]
        sizes = _operand_dims(shape, role.operand)
        dims = (role.axis,) if spec.scaling == "block" else (0, 1)
        for d in dims:
            if sizes[d] % spec.block_size:
                how = f"blocked along {names[d]}" if spec.scaling == "block" else f"{spec.block_size}-tiles"
                raise ConfigError(
                    f"{where_of(role.name)}: {fqn} {role.name}: block_size = {spec.block_size} does not divide "
                    f"{names[d]} = {sizes[d]} ({tensor}, {how} in the {role.gemm} GEMM); use a divisor of "
                    f"{sizes[d]} or exclude the role"
                )


def check_attention_parallelism(fqns: list[str], parallelism) -> None:
    """Quantized attention (emulated) runs with data parallelism only.

    Raises:
        ConfigError: tensor or context parallelism with a quantized attention product.
    """
    for key in ("tensor_parallel_degree", "context_parallel_degree"):
        degree = getattr(parallelism, key, 1)
        if degree > 1 and fqns:
            raise ConfigError(
                f"parallelism.{key} = {degree}: quantized attention ({fqns[0]}) runs with data parallelism "
                "(FSDP2) only; set it to 1 or keep the attention products in high precision"
            )
