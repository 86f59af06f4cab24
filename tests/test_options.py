"""Every option is validated at construction; bad tensors get a clear Python error."""
import dataclasses

import pytest
import torch

from fused_lm_loss import FusedLMLoss, fused_linear_cross_entropy
from fused_lm_loss.integrations import causal_lm_loss
from fused_lm_loss.ops_common import encode
from fused_lm_loss.options import UNSUPPORTED, LossOptions, check_supported

from .conftest import interpreter_numpy_warnings
from .reference import make_inputs, reference_loss, rel_err

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
    ({"ignore_index": 2**63}, "ignore_index"),
    ({"class_weight": torch.ones(5, requires_grad=True)}, "class_weight requires grad"),
    ({"accum_dtype": torch.int32}, "accum_dtype"),
    ({"logits_dtype": torch.bfloat16}, "logits_dtype"),
    ({"grad_scaler": object()}, "grad_scaler"),
    ({"vocab_start": 0, "vocab_size": 10}, "process_group"),
    ({"reduce_grad_input": False}, "reduce_grad_input=False .* needs a process_group"),
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": True}, "temperature"),
    # finite, but outside what fp32 math can carry (options.FP32_SAFE_RANGE): inf / NaN where float64 is finite
    ({"softcap": 1e39}, "softcap"),
    ({"temperature": 1e-39}, "temperature"),
    ({"logit_scale": 2.0**65}, "logit_scale"),
    ({"z_loss": 1e39}, "z_loss"),
    ({"logit_scale": 2.0**40, "temperature": 2.0**-40}, "logit_scale / temperature"),
    ({"softcap": 2.0**60, "logit_scale": 2.0**-10}, "logit_scale / softcap"),
    ({"softcap": 2.0**60, "temperature": 2.0**-10}, "softcap / temperature"),
    ({"process_group": "tp"}, "process_group"),
    ({"ignore_index": "-100"}, "ignore_index"),
    ({"class_weight": torch.ones(10).to_sparse()}, "class_weight"),
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
        (lambda h, w, y, b: (h.to_sparse(), w, y, b), "hidden must be a dense"),
        (lambda h, w, y, b: (h, w.to_sparse_csr(), y, b), "weight must be a dense"),
        (lambda h, w, y, b: (h, w, y.to_sparse(), b), "labels must be a dense"),
    ],
    ids=["label_too_big", "label_negative", "H_mismatch", "labels_shape", "float_labels", "bias_shape", "bias_dtype",
         "float64", "mixed_dtypes", "weight_3d", "sparse_hidden", "sparse_csr_weight", "sparse_labels"],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
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
    with pytest.raises(ValueError, match="scaling must hold one number"):
        FusedLMLoss()(hidden, weight, labels, scaling=torch.ones(2))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        FusedLMLoss()(hidden, weight, labels, num_items_in_batch=0)
    with pytest.raises(ValueError, match="num_items_in_batch"):  # transformers' signature, on logits
        causal_lm_loss(FusedLMLoss().options, hidden @ weight.T, labels, 10, num_items_in_batch=0)


@pytest.mark.parametrize("options", [
    dict(softcap=2.0**63),  # as good as no cap
    dict(logit_scale=2.0**-60, temperature=2.0**-4),  # logits x 2**-56: a near-uniform softmax
    dict(logit_scale=2.0**64, temperature=2.0**60),  # x 16
    dict(softcap=2.0**-30, logit_scale=2.0**30, temperature=2.0**-30),  # logit_scale / softcap = 2**60
    dict(z_loss=2.0**-64, label_smoothing=0.3),
])
@interpreter_numpy_warnings
def test_options_at_the_edges_of_the_fp32_range_match_float64(backend, options):
    """What FP32_SAFE_RANGE admits, at its edges, computes what float64 does (loss and gradients)."""
    hidden, weight, labels, _ = make_inputs(12, 8, 30)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = FusedLMLoss(**options)(h, w, labels)
    loss.backward()
    want, grads = reference_loss(hidden.double().requires_grad_(True), weight.double().requires_grad_(True), labels,
                                 **options)
    assert rel_err(loss, want) < 1e-5
    assert rel_err(h.grad, grads["hidden"]) < 1e-4 and rel_err(w.grad, grads["weight"]) < 1e-4


def test_a_numpy_integer_ignore_index_is_an_int():
    np = pytest.importorskip("numpy")
    hidden, weight, labels, _ = make_inputs(12, 8, 30, ignore_frac=0.0)
    labels[::3] = 7
    fused = FusedLMLoss(ignore_index=np.int64(7))
    assert type(fused.options.ignore_index) is int
    assert torch.equal(fused(hidden, weight, labels), FusedLMLoss(ignore_index=7)(hidden, weight, labels))


def test_repr_shows_changed_options():
    assert "label_smoothing=0.1" in repr(FusedLMLoss(label_smoothing=0.1))


def test_bad_label_among_ignored_ones_raises(backend):
    """The label range is checked over the selected labels only: -100 passes, a bad label next to it does not."""
    hidden, weight, labels, _ = make_inputs(6, 8, 10, ignore_frac=0.0)
    labels[::2] = -100
    FusedLMLoss()(hidden, weight, labels)  # fine
    labels[1] = 10
    with pytest.raises(ValueError, match="outside"):
        FusedLMLoss()(hidden, weight, labels)


# ---- the option schema: one dataclass, generated operator arguments, one table of what each call honours ----

# A value other than the default for every option (a process group is any object until it is used)
SET_VALUES = dict(
    ignore_index=-1, reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=5.0, logit_scale=0.5,
    temperature=0.7, chunk_size=4, accum_dtype=None, logits_dtype=torch.float32,
    grad_scaler=torch.amp.GradScaler("cpu", enabled=False),
    process_group=object(), vocab_start=0, reduce_grad_input=False, class_weight=torch.ones(10),
    return_z_loss=True, return_token_accuracy=True, keep_logits=True,
)


def test_every_option_has_a_set_value_here():
    assert set(SET_VALUES) | {"vocab_size"} == {f.name for f in dataclasses.fields(LossOptions)}


@pytest.mark.parametrize("where", list(UNSUPPORTED))
def test_check_supported_refuses_exactly_the_table(where):
    """Each option refused for ``where`` raises there, naming it; every other option passes."""
    for name, value in SET_VALUES.items():
        values = {name: value}
        if name == "vocab_start":
            values.update(vocab_size=10, process_group=object())
        opts = LossOptions.trusted(**values)
        refused = [n for n in values if n in UNSUPPORTED[where]]
        if refused:
            with pytest.raises(ValueError, match=refused[0]):
                check_supported(opts, where)
        else:
            check_supported(opts, where)


@pytest.mark.parametrize("name", sorted(set(UNSUPPORTED["logits"]) - {"process_group"}))  # (a group: distributed)
def test_logits_loss_refuses_what_needs_hidden_states(name):
    hidden, weight, labels, _ = _good()
    values = {name: SET_VALUES[name]}
    with pytest.raises(ValueError, match=name):
        causal_lm_loss(LossOptions(**values), hidden @ weight.T, labels, 10)


def test_options_cross_the_operator_boundary_unchanged():
    """encode / decode (the operators' generated option arguments) give back every option, by name."""
    from fused_lm_loss.ops_common import KEYWORD_OPTIONS, TENSOR_OPTIONS, decode, encode

    # (trusted: reduce_grad_input=False is valid only with a process group, which encode() would need registered)
    opts = LossOptions.trusted(**{k: v for k, v in SET_VALUES.items()
                                  if k not in ("process_group", "vocab_start", "return_token_accuracy", "grad_scaler")})
    back = decode(*encode(opts))
    for f in dataclasses.fields(LossOptions):
        if f.name != "grad_scaler":  # read on the host before the call: not an operator argument
            assert getattr(back, f.name) is getattr(opts, f.name) or getattr(back, f.name) == getattr(opts, f.name)
    names = set(TENSOR_OPTIONS) | {n for n, _, _ in KEYWORD_OPTIONS}
    assert names == {f.name for f in dataclasses.fields(LossOptions)} - {"grad_scaler"}


OPCHECK_OPTIONS = {
    "default": {},
    "mean_extras": dict(z_loss=1e-2, return_z_loss=True, return_token_accuracy=True, temperature=0.8),
    "none_extras": dict(reduction="none", z_loss=1e-2, return_z_loss=True, return_token_accuracy=True),
    "none_keep_logits": dict(reduction="none", keep_logits=True, softcap=4.0),
    "class_weight": dict(class_weight=torch.rand(10) + 0.5, label_smoothing=0.1),
    "fp32_logits_sum": dict(reduction="sum", logits_dtype=torch.float32),
}


@pytest.mark.parametrize("kind", OPCHECK_OPTIONS)
def test_loss_operator_passes_opcheck(kind):
    """torch.library.opcheck: the schema, the fake implementation (shapes and dtypes of every output, from the
    same spec as the real one), and the autograd registration agree, for each option set."""
    from fused_lm_loss import ops

    opts = LossOptions(chunk_size=4, **OPCHECK_OPTIONS[kind])
    hidden, weight, labels, _ = make_inputs(9, 8, 10, dtype=torch.bfloat16 if opts.logits_dtype else torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    needs = [True, True, False, False, False]
    tensors, keywords = encode(opts)
    args = (hidden, weight, None, None, None, labels, None, None, 1.0, needs, *tensors)
    torch.library.opcheck(ops.linear_cross_entropy.op, args, keywords,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("extras", [(False, False), (True, True)], ids=["base", "extra_outputs"])
@pytest.mark.parametrize("expected_grads", ["logprobs", "logprobs_and_entropy", "uniform"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_token_operator_passes_opcheck(expected_grads, frozen, extras):
    from fused_lm_loss import token_ops

    opts = LossOptions(chunk_size=4, temperature=0.8, keep_logits=True)
    hidden, weight, labels, _ = make_inputs(9, 8, 10)
    hidden.requires_grad_(True)
    weight.requires_grad_(not frozen)
    needs = [True, not frozen, False, False, False]
    tensors, keywords = encode(opts)
    args = (hidden, weight, None, None, None, labels, needs, expected_grads, *extras, *tensors)
    torch.library.opcheck(token_ops.linear_token_stats.op, args, keywords,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
