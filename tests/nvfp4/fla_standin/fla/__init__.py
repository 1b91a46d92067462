"""A stand-in for flash-linear-attention (tests only: put this folder on a child process's PYTHONPATH).
Its functions count their calls into ``$FLA_STANDIN_LOG`` and run transformers' own reference code, so
a test proves that an installed ``fla`` is the kernel transformers binds, without Triton or a GPU."""

from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__version__ = "0.0-standin"
__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]
