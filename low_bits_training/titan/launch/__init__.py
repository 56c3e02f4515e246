"""Launching: the TOML onto torchtitan's ``Trainer.Config``, the whole run checked, torchrun started, and the
one training rank (``worker``) each process runs."""
