"""TRL: the trainers' fused LM head runs on our kernels for patched models.

TRL 1.x adds its own fused LM head to the model at trainer construction (``trl.trainer.utils.add_fused_lm_head``):
the trainer calls ``model(..., fused_lm_head=True)``, which runs the backbone and hands the last hidden states
to ``trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
softcap, logit_scale, outputs)``, bypassing the model's forward and lm_head. TRL has no public way to supply
that function, so ``install()`` replaces this module global (looked up at every call) with ``FusedLogProbs``:
for the lm_head weight of a model patched by ``fused_lm_loss.patch`` it computes the per-token outputs with
``token_stats``; for any other model it calls TRL's own function. Patching before or after the trainer is built
is the same (the lookup is per call). The TRL versions this was tested with are ``SUPPORTED``; others raise.

The patched model's FusedLMLoss options apply: ``chunk_size`` (None: chunks sized by memory, in place of TRL's
fixed chunk), ``accum_dtype`` and ``keep_logits`` (the logits kept for the RL trainers' backward: one matmul fewer,
N x V values more memory; see FusedLMLoss); the temperature, softcap and logit scale are those TRL passes. What
TRL's head cannot express is refused, never dropped (``options.UNSUPPORTED["trl"]``): a patched model's
FusedLMLoss with e.g. label smoothing, a z-loss or fp32 logits raises at the first call. Every output TRL 1.16's
trainers ask for is computed: "log_probs", "entropy", "is_top1", and "mean_logits" / "log_sum_sq_probs" (DPO's
and KTO's logit metrics and WPO weights; detached, as TRL gives them). What we cannot serve (an output a later
TRL adds) runs TRL's own function, with a warning naming the trainer, once per trainer class and reason. A DeepSpeed
ZeRO-3 partitioned head is served: TRL gathers it around the call (``maybe_gather_lm_head_ctx``), and we register it
with the patched model (``integrations/deepspeed.py``) so that DeepSpeed gathers it again before the model's
backward, where our gradients (made in forward, or recomputed) reach its partitioned reduction once.

The distillation trainer's teacher-student divergence (``trl.trainer.distillation_trainer``'s
``ChunkedDivergenceFunction``) is replaced the same way: for a patched student it runs ``fused_divergence`` (the
student's gradients made in forward, the teacher's matmul once), with the student's FusedLMLoss ``chunk_size``;
what the divergence cannot honour raises (``options.UNSUPPORTED["trl_distillation"]``); for any other student
TRL's own function.

TRL 0.x has no fused head: its SFTTrainer computes metrics from ``outputs.logits``, which a patched model does
not make in training; ``check_caller`` raises a clear error there instead of TRL's ``AttributeError``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
import warnings
import weakref
from typing import Any, Callable

import torch

from ..divergence import DivergenceOptions, divergence_with
from ..options import LossOptions, check_supported
from ..per_token import token_stats_with
from . import deepspeed as deepspeed_integration

SUPPORTED = ("1.16.0",)
_COMPUTED = ("log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs")
# patched model -> the function that gives its options (hf_patch.patched_options; held here, not imported: the
# patch imports this module)
_patched_models: "weakref.WeakKeyDictionary[torch.nn.Module, Callable]" = weakref.WeakKeyDictionary()
_trl_function: Any = None  # TRL's own _ChunkedLogProbFunction, once replaced
_trl_divergence: Any = None  # TRL's own ChunkedDivergenceFunction (distillation), once replaced
_warned: set = set()


def register(model: torch.nn.Module, options_of: Callable[[torch.nn.Module], LossOptions]) -> None:
    """Called by patch(): route TRL's fused-head calls for this model's lm_head to our kernels, with the options
    ``options_of(model)`` gives at each call (the loss may be reassigned)."""
    if "trl" not in sys.modules and importlib.util.find_spec("trl") is None:
        return
    _patched_models[model] = options_of
    install()


def unregister(model: torch.nn.Module) -> None:
    _patched_models.pop(model, None)


def install() -> None:
    """Replace TRL's fused-head function (once). TRL 0.x has none; an untested TRL 1.x raises."""
    global _trl_function
    import trl

    major = int(trl.__version__.split(".")[0])
    if major < 1 or _trl_function is not None:
        return
    if trl.__version__ not in SUPPORTED:
        raise RuntimeError(
            f"fused_lm_loss: TRL {trl.__version__} is installed; its fused LM head is replaced by ours only in the "
            f"versions this was tested with: {', '.join(SUPPORTED)} (pip install trl=={SUPPORTED[-1]}), since TRL "
            "offers no public hook for it and its internals change between releases"
        )
    try:
        import trl.trainer.utils as trl_utils
    except ImportError as error:  # (TRL's trainers do not import here, e.g. beside a transformers it does not support)
        warnings.warn(f"fused_lm_loss: TRL {trl.__version__} is installed but its trainers do not import ({error}); "
                      "its fused LM head is not patched", stacklevel=3)
        return
    _trl_function = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = FusedLogProbs
    _install_divergence()


def _install_divergence() -> None:
    global _trl_divergence
    try:
        import trl.trainer.distillation_trainer as distillation
    except ImportError:  # (its optional dependencies)
        return
    _trl_divergence = distillation.ChunkedDivergenceFunction
    distillation.ChunkedDivergenceFunction = FusedDivergenceFunction


def _owner(weight: torch.Tensor):
    """The patched model whose lm_head weight this is, or None (also while another callable than a FusedLMLoss is
    its loss_function: it computes logits then, as unpatched, and TRL's own head serves it). Under FSDP2 TRL passes
    the gathered full tensor of the DTensor parameter: that one is matched by its global shape and dtype."""
    for model, options_of in list(_patched_models.items()):
        own = getattr(model.get_output_embeddings(), "weight", None)
        ours = own is weight or (_is_dtensor(own) and tuple(own.shape) == tuple(weight.shape)
                                 and own.dtype == weight.dtype)
        if ours:
            return model if options_of(model) is not None else None
    return None


def _is_dtensor(t: Any) -> bool:
    if t is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class FusedLogProbs:
    """Stands in for TRL's ``_ChunkedLogProbFunction``: same ``apply`` arguments and outputs."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        model = _owner(weight)
        if model is None:
            _say_unpatched_beside_patched()
            return _trl_function.apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale,
                                       outputs)
        reason = _cannot_serve(outputs)
        if reason is not None:
            trainer = _calling_trainer()
            _warn_once((trainer, reason), f"fused_lm_loss: {reason} ({trainer}): TRL's own fused LM head runs for "
                       "this call")
            return _trl_function.apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale,
                                       outputs)
        opts = _trl_options(model, temperature, softcap, logit_scale)
        deepspeed_integration.register_partitioned_head(model, model.get_output_embeddings())
        if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
            weight = weight.to(hidden.dtype)  # cast_lm_head_to_fp32: fp32 hidden states, the head in fp32
            bias = None if bias is None else bias.to(hidden.dtype)
        extra = [name for name in ("mean_logits", "log_sum_sq_probs") if name in outputs]
        out = token_stats_with(opts, hidden, weight, targets, bias, expected_grads=_expected_grads(outputs),
                               extra_outputs=extra)
        return (
            out.logprobs,
            out.entropy if "entropy" in outputs else None,
            out.log_sum_sq_probs,
            out.mean_logits,
            out.is_top1 if "is_top1" in outputs else None,
        )


class FusedDivergenceFunction:
    """Stands in for TRL's ``ChunkedDivergenceFunction`` (the distillation trainer's loss): same ``apply``
    arguments and outputs, (per-token divergence, per-token student entropy), for every row it is given."""

    @staticmethod
    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
              temperature=1.0, student_logit_scale=1.0, student_softcap=None, teacher_logit_scale=1.0,
              teacher_softcap=None):
        args = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
                temperature, student_logit_scale, student_softcap, teacher_logit_scale, teacher_softcap)
        student = _owner(student_weight)
        if student is None:
            return _trl_divergence.apply(*args)
        # the student's FusedLMLoss: its chunk_size applies; what the divergence cannot honour raises
        loss_opts = _patched_models[student](student)
        check_supported(loss_opts, "trl_distillation", "the patched student's FusedLMLoss, under TRL's distillation "
                        "trainer")
        deepspeed_integration.register_partitioned_head(student, student.get_output_embeddings())
        opts = DivergenceOptions.from_beta(
            float(beta), temperature=float(temperature), student_logit_scale=float(student_logit_scale),
            student_softcap=None if student_softcap is None else float(student_softcap),
            teacher_logit_scale=float(teacher_logit_scale),
            teacher_softcap=None if teacher_softcap is None else float(teacher_softcap), reduction="none",
            chunk_size=loss_opts.chunk_size,
        )
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        # (ZeRO-3: TRL's function gathers both heads itself, not its caller; so do we. The student's head, registered
        # above, is gathered again for backward.)
        with maybe_gather_lm_head_ctx(student_weight, student_bias, teacher_weight, teacher_bias):
            sides = []
            for hidden, weight, bias in ((student_hidden, student_weight, student_bias),
                                         (teacher_hidden, teacher_weight, teacher_bias)):
                if hidden.dtype != weight.dtype and not torch.is_autocast_enabled(hidden.device.type):
                    weight, bias = weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)  # as TRL
                sides.append((hidden, weight, bias))
            (student_hidden, student_weight, student_bias), (teacher_hidden, teacher_weight, teacher_bias) = sides
            out = divergence_with(opts, student_hidden, student_weight, teacher_hidden, teacher_weight,
                                  student_bias=student_bias, teacher_bias=teacher_bias, return_entropy=True)
        return out.divergence, out.entropy


def _say_unpatched_beside_patched() -> None:
    """TRL's head serves a model that is not patched while a patched one exists (a reference model the trainer built
    itself): warn once per trainer, since the two then round differently (e.g. DPO's step-0 reward accuracy)."""
    if len(_patched_models):
        trainer = _calling_trainer()
        _warn_once((trainer, "unpatched"), f"fused_lm_loss ({trainer}): TRL's fused LM head serves a model that is "
                   "not patched (e.g. the reference model the trainer built) beside a patched one: that model runs "
                   "TRL's own kernels, which round differently; patch it too (fused_lm_loss.patch(trainer.ref_model)) "
                   "for one kernel on both sides")


def _expected_grads(outputs) -> str:
    """What backward will most likely weight the log-probabilities with, from the outputs a trainer asks for
    (only the cost depends on this guess: per_token.py). SFT asks for the top-1 (token accuracy) but not the mean
    logit, and differentiates the mean log-probability; DPO and KTO (mean_logits) weight each sequence's sum, the
    RL trainers each token."""
    return "uniform" if "is_top1" in outputs and "mean_logits" not in outputs else "logprobs"


def _cannot_serve(outputs) -> str | None:
    extra = [name for name in outputs if name not in _COMPUTED]
    if extra:
        return f"the per-token outputs {extra} are not computed by fused_lm_loss"
    return None


def _trl_options(model, temperature, softcap, logit_scale) -> LossOptions:
    """The patched model's options for TRL's head: those TRL's head cannot honour raise (``options.UNSUPPORTED``);
    the temperature, softcap and logit scale are the ones TRL passes."""
    opts = _patched_models[model](model)
    check_supported(opts, "trl", "the patched model's FusedLMLoss, under TRL's fused LM head")
    return dataclasses.replace(opts, temperature=float(temperature), logit_scale=float(logit_scale),
                               softcap=None if softcap is None else float(softcap))


def _calling_trainer() -> str:
    """The class name of the TRL trainer this call comes from (its ``self`` in a calling frame), or "TRL"."""
    frame = sys._getframe(2)
    for _ in range(30):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__module__.startswith("trl.") and type(owner).__name__.endswith("Trainer"):
            return type(owner).__name__
        frame = frame.f_back
    return "TRL"


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def check_caller() -> None:
    """With TRL 0.x loaded, a patched training forward called from its SFTTrainer raises a clear error: that
    trainer reads outputs.logits (entropy, token accuracy), which a patched model does not compute."""
    trl = sys.modules.get("trl")
    if trl is None or int(getattr(trl, "__version__", "1").split(".")[0]) >= 1:
        return
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return
        if frame.f_code.co_name == "compute_loss" and "trl" in frame.f_code.co_filename:
            raise RuntimeError(
                f"fused_lm_loss: TRL {trl.__version__}'s SFTTrainer computes its metrics from outputs.logits, which a "
                f"patched model does not compute in training. Upgrade TRL (pip install trl=={SUPPORTED[-1]}: patch() "
                "then runs TRL's fused LM head on fused_lm_loss's kernels), or use transformers' Trainer"
            )
        frame = frame.f_back
