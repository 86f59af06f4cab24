"""The other LM-loss implementations the benchmarks compare against, each optional (None when missing).

    liger_loss()        LigerFusedLinearCrossEntropyLoss (liger-kernel)
    cce_loss()          cut_cross_entropy.linear_cross_entropy (cut-cross-entropy)
    trl_kernel()        TRL's ChunkedLogProbFunction module (trl/kernels/chunked_logprob.py, TRL >= 1.16)
    trl_fused_head()    trl.trainer.utils.add_fused_lm_head, the model patch TRL's trainers apply
    trl_sft_loss(...)   the loss as TRL's fused head computes it (SFT: mean NLL over the non-ignored tokens)
    quack_loss()        quack.linear_cross_entropy.chunked_linear_cross_entropy (quack-kernels, NVIDIA CuTe DSL)

Quack 0.6.5 does not import against nvidia-cutlass-dsl 4.7.1 / 4.8.1 as released: building its own epilogue
library, its compile-cache key (``quack.gemm_runtime.identity.semantic_value_key``) meets objects that the
DSL's helpers close over (a ContextVar in 4.8.1, a logging.Logger in 4.7.1, a code object's method) and
raises TypeError. ``quack_loss`` keys such objects by their type instead; they do not change the math that
Quack traces between our calls (fixed shapes and dtypes per benchmark row). For measuring only: a library
could not ship that.

TRL's kernel file needs only torch, packaging and ``transformers.utils``, but ``trl.trainer.utils`` (which
``add_fused_lm_head`` lives in, and which the kernel's backward imports at call time for DeepSpeed's
``maybe_gather_lm_head_ctx``) imports accelerate, datasets, pandas... at top level. So: the real
``trl.trainer.utils`` when it imports; else the kernel module alone, with a stand-in ``trl.trainer.utils``
whose ``maybe_gather_lm_head_ctx`` is the null context TRL's returns without ZeRO-3; else (the ``trl``
package itself does not import) the kernel file loaded by path under stand-in parent packages.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import sys
import types

#: the vocabulary width of a tile, as trl/trainer/utils.py passes it (_CHUNKED_LOGPROB_CHUNK_SIZE)
TRL_CHUNK_SIZE = 32768
#: what SFTTrainer asks the fused head for (sft_trainer.py: loss, and entropy / token accuracy for its logs)
TRL_SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")

_trl_state: dict = {}


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def liger_loss():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=-100)


def cce_loss():
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy


def quack_loss():
    """Quack's ``chunked_linear_cross_entropy(x, weight, target, chunk_size, ignore_index, reduction, tuned,
    use_scaled_exp)`` (see the module docstring for the import shim)."""
    return quack_lce().chunked_linear_cross_entropy


def quack_lce():
    """The module ``quack.linear_cross_entropy``, imported through the shim (module docstring)."""
    import quack.gemm_runtime.identity as identity

    if not getattr(identity.semantic_value_key, "_keyed_by_type", False):
        original = identity.semantic_value_key

        def semantic_value_key(value, seen):
            try:
                return original(value, seen)
            except TypeError:
                return ("by-type", type(value).__module__, type(value).__qualname__)

        semantic_value_key._keyed_by_type = True
        identity.semantic_value_key = semantic_value_key
    import quack.linear_cross_entropy as lce

    return lce


def _stub_trainer_utils() -> types.ModuleType:
    stub = types.ModuleType("trl.trainer.utils")
    stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()  # TRL's, without DeepSpeed ZeRO-3
    stub.__file__ = "<fused_lm_loss benchmarks stand-in>"
    return stub


def _load_trl():
    """Fill _trl_state: module (the kernel module), fused_head (add_fused_lm_head or None), how, error."""
    if _trl_state:
        return _trl_state
    try:
        import trl.trainer.utils as utils  # noqa: F401 - the real thing: add_fused_lm_head, the backward's import
        import trl.kernels.chunked_logprob as module

        _trl_state.update(module=module, fused_head=utils.add_fused_lm_head, how="trl.trainer.utils")
        return _trl_state
    except Exception as e:  # noqa: BLE001 - any import failure: try the kernel alone
        reason = f"trl.trainer.utils: {type(e).__name__}: {str(e)[:120]}"
    try:
        import trl.kernels.chunked_logprob as module

        sys.modules["trl.trainer.utils"] = _stub_trainer_utils()
        _trl_state.update(module=module, fused_head=None, how=f"kernel module only ({reason})")
        return _trl_state
    except Exception as e:  # noqa: BLE001
        reason += f"; trl.kernels: {type(e).__name__}: {str(e)[:120]}"
    try:
        spec = importlib.util.find_spec("trl")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("trl is not installed")
        root = list(spec.submodule_search_locations)[0]
        for name, folder in (("trl", root), ("trl.kernels", os.path.join(root, "kernels")),
                             ("trl.trainer", os.path.join(root, "trainer"))):
            if name not in sys.modules:
                package = types.ModuleType(name)
                package.__path__ = [folder]
                sys.modules[name] = package
        sys.modules["trl.trainer.utils"] = _stub_trainer_utils()
        path = os.path.join(root, "kernels", "chunked_logprob.py")
        file_spec = importlib.util.spec_from_file_location("trl.kernels.chunked_logprob", path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules["trl.kernels.chunked_logprob"] = module
        file_spec.loader.exec_module(module)
        _trl_state.update(module=module, fused_head=None, how=f"kernel file {path} ({reason})")
    except Exception as e:  # noqa: BLE001
        sys.modules.pop("trl.kernels.chunked_logprob", None)
        _trl_state.update(module=None, fused_head=None, how=None, error=f"{reason}; file: {type(e).__name__}: {e}")
    return _trl_state


def trl_kernel():
    """TRL's chunked_logprob module (has ChunkedLogProbFunction), or raises ImportError."""
    state = _load_trl()
    if state["module"] is None or not hasattr(state["module"], "ChunkedLogProbFunction"):
        raise ImportError(state.get("error", "trl.kernels.chunked_logprob has no ChunkedLogProbFunction"))
    return state["module"]


def trl_fused_head():
    """trl.trainer.utils.add_fused_lm_head, or None when only the kernel imports."""
    trl_kernel()
    return _trl_state["fused_head"]


def trl_how() -> str | None:
    return _load_trl().get("how")


def _trl_apply(module, hidden, weight, labels, bias, softcap, logit_scale, outputs):
    """TRL's ChunkedLogProbFunction at temperature 1, called as its trainers call it: on Triton devices (CUDA)
    only the rows that carry a loss ("compact"), else every row with its label clamped at 0.
    Returns (the kept-label mask, compact, the function's per-token outputs)."""
    use_triton = getattr(module, "_use_triton", lambda device: device.type == "cuda")
    mask = labels != -100
    compact = use_triton(hidden.device)
    per_token = module.ChunkedLogProbFunction.apply(
        hidden[mask] if compact else hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        labels[mask] if compact else labels.clamp(min=0).reshape(-1),
        1.0,
        TRL_CHUNK_SIZE,
        softcap,
        logit_scale,
        tuple(outputs),
    )
    return mask, compact, per_token


def trl_sft_loss(module, hidden, weight, labels, *, bias=None, softcap=None, logit_scale=1.0, outputs=("log_probs",)):
    """The loss of TRL's fused head (``_fused_forward`` of add_fused_lm_head, SFT: temperature 1) on hidden
    states (..., H) and labels (...) that are already shifted.

    As TRL does: on Triton devices (CUDA) only the rows that carry a loss go to the kernel ("compact":
    ``hidden[mask]``), else every row with its label clamped at 0; the per-token log-probs are scattered
    back (0 where ignored), and loss = -sum(log_probs) / max(count, 1).
    """
    mask, compact, per_token = _trl_apply(module, hidden, weight, labels, bias, softcap, logit_scale, outputs)
    log_probs = per_token[0]
    if compact:
        log_probs = log_probs.new_zeros(mask.shape).masked_scatter(mask, log_probs)
    else:
        log_probs = log_probs.view(mask.shape).masked_fill(~mask, 0)
    return -log_probs.sum() / mask.sum().clamp(min=1)


def trl_weighted_logprobs(module, hidden, weight, labels, token_weights, *, entropy_weight=0.0,
                          outputs=("log_probs", "entropy")):
    """sum(token_weights * log_probs) (+ entropy_weight * sum(entropy)) through TRL's fused head, called as its
    RL trainers do (GRPO: per-token advantages on the log-probabilities; entropy in the outputs) or, with DPO's
    ``outputs``, as DPOTrainer does."""
    mask, compact, (log_probs, entropy, *_) = _trl_apply(module, hidden, weight, labels, None, None, 1.0, outputs)
    weights = token_weights[mask] if compact else token_weights.masked_fill(~mask, 0).reshape(-1)
    total = (log_probs * weights).sum()
    if entropy_weight:
        total = total + entropy_weight * (entropy * (1.0 if compact else mask.reshape(-1))).sum()
    return total
