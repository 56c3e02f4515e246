"""``[job]``: where a config starts from and what the run is called (a ``Section``: checked when built, when
the TOML sets it and when a command-line flag rebuilds it). The one ``[job]`` class: the TOML loader reads
it before the base is known, and the trainer's config tree holds it (``titan/runtime/trainer.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, ClassVar

from low_bits_training.config.section import Matches, Section

BASE_SHAPE = Matches(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "'module:function', e.g. 'llama3:llama3_debugmodel'")
NAME_SHAPE = Matches(
    r"([A-Za-z0-9][A-Za-z0-9._-]*)?", "letters, digits, '.', '_' and '-' (it names a folder)"
)
RUNS_FOLDER = "outputs"
"""Where a named run's folder goes: ``outputs/<name>`` (relative to where the run starts)."""


@dataclass(kw_only=True, slots=True)
class JobConfig(Section):
    """``[job]``: where the config starts from and what the run is called."""

    SECTION: ClassVar[str] = "job"

    base: Annotated[str, BASE_SHAPE] = "llama3:llama3_debugmodel"
    """Base config function, ``module:function``: a torchtitan model name (``llama3``), a dotted module with
    a ``config_registry`` (or the module itself), and a function in it returning a ``Trainer.Config``."""

    name: Annotated[str, NAME_SHAPE] = ""
    """Run name. Sets ``dump_folder`` to ``outputs/<name>`` unless ``dump_folder`` is given (in the TOML or
    on the command line); ``--job.name`` on the command line does it too."""

    description: str = ""
    """Free text, kept with the run."""

    def run_folder(self) -> str | None:
        """``outputs/<name>``, or None for a run without a name."""
        return os.path.join(RUNS_FOLDER, self.name) if self.name else None
