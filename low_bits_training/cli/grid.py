"""A sweep's grid: a base TOML plus keys -> values, every key a launcher override (``--quantize.recipe``).

Grid file (TOML)::

    config_file = "train_configs/debug_model.toml"
    name = "precision"                        # runs go to outputs/sweeps/precision/<point>
    args = ["--training.steps", "200"]        # the same overrides for every point
    baseline = { "quantize.recipe" = "bf16" } # the row the others are compared with (default: the first)
    seed_key = "debug.seed"                   # points that differ only here are one row (mean +- std)
    [grid]
    "quantize.recipe" = ["bf16", "fp8_rowwise"]
    "debug.seed" = [0, 1, 2]
    nproc = [1]                               # processes per node (parallelism); any other key is an override
"""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from low_bits_training.errors import ConfigError

NPROC = "nproc"
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ALLOWED = ("config_file", "name", "args", "baseline", "seed_key", "grid")


@dataclass(frozen=True)
class Point:
    """One run of the sweep."""

    values: dict[str, Any]
    """Grid key -> value for this run."""
    args: tuple[str, ...]
    """Launcher overrides: the sweep's fixed ``args`` then this point's values."""
    nproc: int = 1
    """Processes per node."""
    name: str = "base"
    """Folder-safe name from the axes that vary: ``recipe-fp8_rowwise_seed-1``."""


@dataclass(frozen=True)
class Grid:
    """A sweep: the base TOML, the grid, and how points group into table rows."""

    config_file: str
    """Base TOML every point starts from."""
    name: str = "sweep"
    """Sweep name: the output folder ``outputs/sweeps/<name>``."""
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Override key (``debug.seed``, ``quantize.recipe``, or ``nproc``) -> values."""
    args: tuple[str, ...] = ()
    """Overrides common to every point."""
    baseline: dict[str, Any] | None = None
    """The values that pick the baseline row (None: the first row)."""
    seed_key: str = "debug.seed"
    """Grid key whose values are repeats of one configuration."""

    def __post_init__(self):
        for k, values in self.grid.items():
            if not _KEY.match(k):
                raise ConfigError(f"grid key {k!r}: expected a dotted override name like 'debug.seed'")
            if not isinstance(values, list) or not values:
                raise ConfigError(f"grid.{k} = {values!r}: expected a non-empty list of values")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            raise ConfigError(f"name = {self.name!r}: use letters, digits, '.', '_' and '-'")
        for k in self.baseline or {}:
            if k not in self.grid:
                raise ConfigError(f"baseline key {k!r}: not a grid key (grid keys: {', '.join(self.grid)})")

    def points(self) -> list[Point]:
        """Every combination, the first key varying slowest."""
        keys = list(self.grid)
        return [
            self._point(dict(zip(keys, combo, strict=True)))
            for combo in itertools.product(*(self.grid[k] for k in keys))
        ]

    def _point(self, values: dict[str, Any]) -> Point:
        args = list(self.args)
        for k, v in values.items():
            if k != NPROC:
                args += override(k, v)
        nproc = int(values.get(NPROC, 1))
        parts = [f"{k.split('.')[-1]}-{v}" for k, v in values.items() if len(self.grid[k]) > 1]
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(parts) or "base")
        return Point(values, tuple(args), nproc, name)

    def group_key(self, point: Point) -> tuple[tuple[str, Any], ...]:
        """The point's values without the seed: points with the same key form one table row."""
        return tuple((k, v) for k, v in point.values.items() if k != self.seed_key)


def override(key: str, value: Any) -> list[str]:
    """A grid value as launcher flags: ``--a.b v``; booleans as tyro's ``--a.b`` / ``--a.no-b``."""
    if isinstance(value, bool):
        head, _, last = key.rpartition(".")
        return [f"--{key}"] if value else [f"--{head + '.' if head else ''}no-{last}"]
    return [f"--{key}", str(value)]


def parse_value(text: str) -> Any:
    """A CLI grid value: TOML scalar syntax (``3e-4``, ``true``, ``1``), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_pairs(items: list[str], what: str) -> dict[str, list[Any]]:
    """``["debug.seed=0,1", "nproc=1"]`` -> ``{"debug.seed": [0, 1], "nproc": [1]}``.

    Raises:
        ConfigError: an item without ``=``.
    """
    out: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what} {item!r}: expected key=value[,value...], e.g. debug.seed=0,1,2")
        out[key.removeprefix("--")] = [parse_value(v) for v in values.split(",")]
    return out


def load_grid(
    path: str | None,
    config_file: str | None = None,
    name: str | None = None,
    grid: list[str] = (),
    baseline: list[str] = (),
    args: list[str] = (),
) -> Grid:
    """The grid from a TOML file, with command-line values on top (CLI grid keys replace file keys).

    Raises:
        ConfigError: unknown top-level key, bad key or value, or no base config.
    """
    data: dict[str, Any] = {}
    if path:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        unknown = sorted(set(data) - set(_ALLOWED))
        if unknown:
            raise ConfigError(f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(_ALLOWED)}")
    config = config_file or data.get("config_file")
    if not config:
        raise ConfigError("config_file: not given (grid file key or --config-file)")
    base = {k: v[0] for k, v in parse_pairs(list(baseline), "--baseline").items()} or data.get("baseline")
    return Grid(
        config_file=config,
        name=name or data.get("name", "sweep"),
        grid={**data.get("grid", {}), **parse_pairs(list(grid), "--grid")},
        args=tuple(data.get("args", [])) + tuple(args),
        baseline=base,
        seed_key=data.get("seed_key", "debug.seed"),
    )
