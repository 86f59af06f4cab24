"""Every option is validated at construction; bad tensors get a clear Python error."""
import pytest
import torch

from fused_lm_loss import FusedLMLoss, fused_linear_cross_entropy
from fused_lm_loss.integrations import causal_lm_loss

from .reference import make_inputs

BAD_OPTIONS = [
    ({"reduction": "avg"}, "reduction"),
    ({"label_smoothing": -0.1}, "label_smoothing"),
    ({"label_smoothing": 1.5}, "label_smoothing"),
    ({"label_smoothing": float("nan")}, "label_smoothing"),
    ({"softcap": 0.0}, "softcap"),
    ({"softcap": -3.0}, "softcap"),
    ({"z_loss": -1e-4}, "z_loss"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": 2.5}, "chunk_size"),
    ({"logit_scale": 0.0}, "logit_scale"),
    ({"logit_scale": float("inf")}, "logit_scale"),
    ({"ignore_index": 1.0}, "ignore_index"),
    ({"accum_dtype": torch.int32}, "accum_dtype"),
    ({"logits_dtype": torch.bfloat16}, "logits_dtype"),
    ({"grad_scaler": object()}, "grad_scaler"),
    ({"vocab_start": 0, "vocab_size": 10}, "process_group"),
]


@pytest.mark.parametrize("options,match", BAD_OPTIONS, ids=[m for _, m in BAD_OPTIONS])
def test_invalid_options_raise_at_construction(options, match):
    with pytest.raises(ValueError, match=match):
        FusedLMLoss(**options)
    hidden, weight, labels, _ = make_inputs(4, 8, 10)
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(hidden, weight, labels, **options)


def _good():
    return make_inputs(6, 8, 10, ignore_frac=0.0)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda h, w, y, b: (h, w, torch.where(y == y[0], 10, y), b), "outside"),
        (lambda h, w, y, b: (h, w, torch.where(y == y[0], -1, y), b), "outside"),
        (lambda h, w, y, b: (h[:, :4], w, y, b), "hidden size"),
        (lambda h, w, y, b: (h, w, y[:5], b), "labels shape"),
        (lambda h, w, y, b: (h, w, y.float(), b), "integer"),
        (lambda h, w, y, b: (h, w, y, torch.zeros(9)), "bias"),
        (lambda h, w, y, b: (h, w, y, torch.zeros(10, dtype=torch.float64)), "bias"),
        (lambda h, w, y, b: (h.double(), w.double(), y, b), "float32, bfloat16 or float16"),
        (lambda h, w, y, b: (h.bfloat16(), w, y, b), "dtype"),
        (lambda h, w, y, b: (h, w[None], y, b), r"weight \(V, H\)"),
    ],
    ids=["label_too_big", "label_negative", "H_mismatch", "labels_shape", "float_labels", "bias_shape", "bias_dtype",
         "float64", "mixed_dtypes", "weight_3d"],
)
def test_bad_tensors_raise_value_error(backend, mutate, match):
    hidden, weight, labels, _ = _good()
    with pytest.raises(ValueError, match=match):
        FusedLMLoss()(*mutate(hidden, weight, labels, None))


def test_low_rank_shapes_checked():
    hidden, weight, labels, _ = _good()
    with pytest.raises(ValueError, match="low_rank"):
        FusedLMLoss()(hidden, weight, labels, low_rank=(torch.randn(6, 2), torch.randn(10, 3)))


def test_bad_scaling_and_num_items():
    hidden, weight, labels, _ = _good()
    with pytest.raises(ValueError, match="scaling"):
        FusedLMLoss()(hidden, weight, labels, scaling=-1.0)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        FusedLMLoss()(hidden, weight, labels, num_items_in_batch=0)
    with pytest.raises(ValueError, match="num_items_in_batch"):  # transformers' signature, on logits
        causal_lm_loss(FusedLMLoss().options, hidden @ weight.T, labels, 10, num_items_in_batch=0)


def test_repr_shows_changed_options():
    assert "label_smoothing=0.1" in repr(FusedLMLoss(label_smoothing=0.1))


def test_bad_label_among_ignored_ones_raises(backend):
    """The label range is checked over the kept labels only: -100 passes, a bad label next to it does not."""
    hidden, weight, labels, _ = make_inputs(6, 8, 10, ignore_frac=0.0)
    labels[::2] = -100
    FusedLMLoss()(hidden, weight, labels)  # fine
    labels[1] = 10
    with pytest.raises(ValueError, match="outside"):
        FusedLMLoss()(hidden, weight, labels)
