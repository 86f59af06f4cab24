"""Triton kernels, one job per file. Imported only when a Triton path runs (CUDA, or TRITON_INTERPRET=1)."""
from .grad_logits import grad_logits
from . import matmul_stats
from .matmul_stats import matmul_row_losses, matmul_row_stats
from .row_stats import row_losses, row_stats

__all__ = ["grad_logits", "matmul_row_losses", "matmul_row_stats", "matmul_stats", "row_losses", "row_stats"]
