"""Tensor constants made once per key and kept (sign vectors, decode tables): one home for the rule of what
may be kept.

Only a plain tensor is kept. A constant first asked for while torch.compile traces, or under a fake mode (the
memory planner's ``FakeTensorMode``, ``titan/runtime/peak.py``), is made for that call and not kept: a kept
``FakeTensor`` would stand in for the values in every later eager call of the process, which then fails on the
first data-dependent op (``DataDependentOutputException``), an order-dependent failure of any process that
plans a run before it trains or tests one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


def kept(cache: dict, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cache[key]``, made by ``make()`` on first use; a traced or fake result is returned but not kept."""
    if torch.compiler.is_compiling():  # a constant of the graph, never the kept tensor (as before `kept`)
        return make()
    if key in cache:
        return cache[key]
    t = make()
    if type(t) is torch.Tensor:  # not a FakeTensor, FunctionalTensor or other subclass
        cache[key] = t
    return t
