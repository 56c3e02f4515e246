"""Everything that touches torchtitan, in four rooms by lifecycle; each imports only the rooms before it.

- ``platform/``: what every process stands on: the CPU adapters, the compat guard, which rank this is, the
  upstream log lines no user can act on filtered out.
- ``targets/``: the precision plan's targets in torchtitan, one module per kind (``linear``, ``experts``,
  ``attention``, ``wire``, ``saved``), their registry (``kind``, ``registry``), the schedule, delayed scaling.
- ``runtime/``: the running trainer: steps, checkpoints, metrics, the numerics monitor, profiling.
- ``launch/``: the TOML onto ``Trainer.Config``, the checks, torchrun, and the per-rank ``worker``.

The config sections the trainer carries (``[job]``, ``[quantize]``, ``[numerics]``, ``[profiling]``) live in
``low_bits_training/config/``; their pure resolution in ``low_bits_training/plan/``.
"""
