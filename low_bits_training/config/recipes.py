"""``[quantize] recipe``: the recipe names a TOML file may give, and their role -> spec tables.

The table itself (each recipe's specs and the sources they follow) is ``nn.recipes.RECIPES``, where
``LinearPlan.from_recipe`` reads it too.
"""

from __future__ import annotations

from typing import Literal

from low_bits_training.formats import QuantSpec
from low_bits_training.nn.recipes import RECIPES

RecipeName = Literal[tuple(RECIPES)]  # type: ignore[valid-type]  # the names, read from the one table
"""A recipe name (``Literal`` of ``RECIPES``' keys: what ``[quantize] recipe`` accepts, tyro's choices)."""


def recipe_specs(name: str) -> dict[str, QuantSpec | None]:
    """The role -> spec table of a named recipe.

    Raises:
        KeyError: unknown name (the message lists the allowed names).
    """
    if name not in RECIPES:
        raise KeyError(f"quantize.recipe = {name!r}: expected one of {', '.join(RECIPES)}")
    return dict(RECIPES[name])


__all__ = ["RECIPES", "RecipeName", "recipe_specs"]
