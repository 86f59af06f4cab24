"""Triton kernels, one job per file: the "triton" backend (see ``backends.Backend``).

Imported only when a Triton path runs (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). The helpers the
kernels share are ``transform.py`` (the logit transform and its chain rule) and ``online.py`` (online softmax
merges).

A file with ``@triton.jit`` functions has no ``from __future__ import annotations``: Triton 3.1's interpreter
tells a ``tl.constexpr`` parameter by its annotation object, and a string annotation makes it a runtime value.
"""
from . import matmul_stats
from ..exp_epilogue import exp_matmul
from ..exp_epilogue import supported as supports_exp_epilogue
from .divergence import divergence_rows
from .grad_from_exp import grad_from_exp
from .grad_logits import grad_logits, token_grad_logits
from .matmul_stats import matmul_partials
from .matmul_stats import partial_bytes_per_row as matmul_partial_bytes_per_row
from .matmul_stats import supported as supports_stats_in_matmul
from .row_stats import merge_exp_stats, merge_partials, row_losses, row_stats
from .scale_grad import scale_grad
from .select_rows import select_rows
from .token_stats import token_stats

name = "triton"

__all__ = [
    "divergence_rows", "exp_matmul", "grad_from_exp", "grad_logits", "matmul_partial_bytes_per_row",
    "matmul_partials", "matmul_stats", "merge_exp_stats", "merge_partials", "name", "row_losses", "row_stats",
    "scale_grad", "select_rows", "supports_exp_epilogue", "supports_stats_in_matmul", "token_grad_logits", "token_stats",
]
