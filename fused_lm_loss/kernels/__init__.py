"""Triton kernels, one job per file. Imported only when a Triton path runs (CUDA, or TRITON_INTERPRET=1)."""
from . import matmul_stats
from .grad_logits import grad_logits
from .kept_rows import kept_rows
from .row_stats import merge_partials, row_losses, row_stats

__all__ = ["grad_logits", "kept_rows", "matmul_stats", "merge_partials", "row_losses", "row_stats"]
