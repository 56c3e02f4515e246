"""Everything that touches torchtitan, in four rooms by lifecycle; each imports only the rooms before it.

- ``platform/``: what every process stands on: the CPU adapters, the compat guard, which rank this is, the
  upstream log lines no user can act on filtered out.
- ``targets/``: the precision plan's targets in torchtitan, one module per kind (``linear``, ``experts``,
  ``attention``, ``wire``, ``saved``), their registry (``kind``, ``registry``), the schedule, delayed scaling.
- ``runtime/``: the running trainer: steps, checkpoints, metrics, the numerics monitor, profiling.
- ``launch/``: the TOML onto ``Trainer.Config``, the checks, torchrun, and the per-rank ``worker``.

The config sections the trainer carries (``[job]``, ``[quantize]``, ``[numerics]``, ``[profiling]``) live in
``low_bits_training/config/``; their pure resolution in ``low_bits_training/plan/``.

Importing any module of titan first puts the platform in (``platform.stand``): the upstream lines no user can
act on are filtered (``platform/noise.py``) and, on a machine without an accelerator, torchtitan's device
module points at the CPU (``platform/cpu.py``, adapter 1), before any torchtitan module is imported. So every
module here imports torchtitan at its top, and no entry point has to remember an order.
"""

from low_bits_training.titan.platform.stand import stand

stand()
