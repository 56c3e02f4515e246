"""low-bits-training: low-bit precision LLM training research on torchtitan."""

__version__ = "0.1.0"
