"""TRL 1.x trainers on a patched model: TRL's fused LM head runs on our kernels, with every logged metric and the
trained parameters equal to TRL's own head (fp32 round-off, CPU); what TRL's head cannot express is refused."""
from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import fused_lm_loss
import fused_lm_loss.integrations.trl as trl_integration

from ..conftest import TEST_DEVICE
from .hf_models import VOCAB, assert_same_training, make_model, rel_err

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(int(trl.__version__.split(".")[0]) < 1, reason="TRL 1.x")

METRICS = ("loss", "entropy", "mean_token_accuracy")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    fast = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=fast, pad_token="t0", eos_token="t2", unk_token="t1")


def _rows(kind: str, n: int = 12, seed: int = 0) -> list:
    """Pre-tokenized rows; the completion / assistant masks are what TRL makes of prompt-completion and
    conversational datasets, and TRL turns them into labels."""
    g = torch.Generator("cpu").manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 11, (1,), generator=g, device="cpu"))
        ids = torch.randint(3, VOCAB, (length,), generator=g, device="cpu").tolist()
        row = {"input_ids": ids}
        cut = int(torch.randint(1, length - 2, (1,), generator=g, device="cpu"))
        if kind == "completion_only":
            row["completion_mask"] = [0] * cut + [1] * (length - cut)
        if kind == "assistant_only":
            row["assistant_masks"] = [0] * cut + [1] * (length - cut - 1) + [0]
        rows.append(row)
    return rows


def _train(tmp_path, *, impl: str, kind: str = "plain", lora: bool = False, grad_accum: int = 1,
           loss_fn=None, monkeypatch=None):
    """Train 3 steps with SFTTrainer; impl: "trl" (TRL's own head), "patched_before" / "patched_after" the
    trainer is built. Returns (log history, final parameters, our kernel calls)."""
    model = make_model("llama")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if impl == "patched_before":
        fused_lm_loss.patch(model, loss_fn)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / impl), per_device_train_batch_size=2, gradient_accumulation_steps=grad_accum,
        max_steps=3, logging_steps=1, eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=2,
        report_to=[], save_strategy="no", use_cpu=TEST_DEVICE == "cpu", seed=0, learning_rate=0.5,
        # on a GPU run TRL's collator makes its tensors on the default device (CUDA), which cannot be pinned
        dataloader_pin_memory=False,
        # fp32 (SFTConfig's default is bf16 autocast), and SGD (Adam would turn round-off in near-zero gradients
        # into whole steps): so that the two heads agree to fp32 round-off
        bf16=False, optim="sgd",
        completion_only_loss=kind == "completion_only",
    )
    trainer = trl.SFTTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(_rows(kind)),
        eval_dataset=datasets.Dataset.from_list(_rows(kind, n=4, seed=1)), processing_class=tiny_tokenizer(),
    )
    if impl == "patched_after":
        fused_lm_loss.patch(trainer.model, loss_fn)
    return _trained(trainer, monkeypatch, "token_stats_with")


def _trained(trainer, monkeypatch, spied: str):
    """Train; (log history, final parameters, how often training called ``trl_integration.<spied>``: our kernels'
    entry; 0 without ``monkeypatch``)."""
    calls = []
    if monkeypatch is not None:
        original = getattr(trl_integration, spied)
        monkeypatch.setattr(trl_integration, spied, lambda *a, **k: calls.append(1) or original(*a, **k))
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, params, len(calls)


def _assert_same_run(got, want, tol=1e-5):
    got_logs, got_params, _ = got
    want_logs, want_params, _ = want
    assert len(got_logs) == len(want_logs)
    for g, w in zip(got_logs, want_logs):
        assert g.keys() == w.keys()
        for key in [*METRICS, "eval_loss", "eval_entropy", "eval_mean_token_accuracy"]:
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=tol, abs=1e-7), key
    assert got_params.keys() == want_params.keys()
    for name, value in want_params.items():
        assert rel_err(got_params[name], value) <= tol, name


@pytest.mark.parametrize("when", ["patched_before", "patched_after"])
@pytest.mark.parametrize("setup", [
    dict(), dict(lora=True), dict(grad_accum=2), dict(kind="completion_only"), dict(kind="assistant_only"),
], ids=["full", "lora_qv", "grad_accum", "completion_only", "assistant_only"])
def test_sft_trainer_runs_our_kernels_with_trls_numbers(tmp_path, monkeypatch, when, setup):
    want = _train(tmp_path, impl="trl", **setup)
    got = _train(tmp_path, impl=when, monkeypatch=monkeypatch, **setup)
    assert got[2] > 0  # our kernels ran: every training and eval step, through TRL's fused head
    assert any("entropy" in log and "mean_token_accuracy" in log for log in got[0])
    _assert_same_run(got, want)


def test_options_trls_head_cannot_express_are_refused(tmp_path):
    with pytest.raises(ValueError, match="label_smoothing"):
        _train(tmp_path, impl="patched_before", loss_fn=fused_lm_loss.FusedLMLoss(label_smoothing=0.1))
    with pytest.raises(ValueError, match="z_loss"):
        _train(tmp_path, impl="patched_after", loss_fn=fused_lm_loss.FusedLMLoss(z_loss=1e-4))


@pytest.mark.parametrize("options", [
    dict(label_smoothing=0.1), dict(z_loss=1e-4), dict(temperature=0.5), dict(ignore_index=-1),
    dict(reduction="sum"), dict(logits_dtype=torch.float32),
], ids=lambda o: next(iter(o)))
def test_every_option_trls_head_cannot_honour_raises_at_the_call(options):
    """Each option of the patched loss that TRL's head cannot honour raises at the first call, naming it."""
    from trl.trainer.utils import _ChunkedLogProbFunction

    model = fused_lm_loss.patch(make_model("llama"), fused_lm_loss.FusedLMLoss(**options))
    w = model.get_output_embeddings().weight
    with pytest.raises(ValueError, match=next(iter(options))):
        _ChunkedLogProbFunction.apply(torch.randn(4, 32), w, None, torch.randint(0, VOCAB, (4,)), 1.0, 32768, None,
                                      1.0, ("log_probs", "entropy"))


def test_chunk_size_and_accum_dtype_reach_trls_calls(monkeypatch):
    """The patched loss's chunk_size and accum_dtype are honoured under TRL's head (never silently dropped), and
    TRL's temperature / softcap / logit scale are applied: outputs and gradients against float64."""
    import fused_lm_loss.token_ops as token_ops
    from trl.trainer.utils import _ChunkedLogProbFunction

    plans, options = [], []
    make_plan, token_stats_with = token_ops.make_plan, trl_integration.token_stats_with
    monkeypatch.setattr(token_ops, "make_plan", lambda *a, **k: plans.append(make_plan(*a, **k)) or plans[-1])
    monkeypatch.setattr(trl_integration, "token_stats_with",
                        lambda opts, *a, **k: options.append(opts) or token_stats_with(opts, *a, **k))
    model = fused_lm_loss.patch(make_model("llama"), fused_lm_loss.FusedLMLoss(chunk_size=3, accum_dtype=None))
    w = model.get_output_embeddings().weight
    hidden, targets = torch.randn(10, 32, requires_grad=True), torch.randint(0, VOCAB, (10,))
    temperature, softcap, scale = 0.7, 5.0, 1.3
    lp, entropy, *_ = _ChunkedLogProbFunction.apply(hidden, w, None, targets, temperature, 32768, softcap, scale,
                                                    ("log_probs", "entropy"))
    a = torch.randn(10)
    (lp * a).sum().backward()
    assert plans and all(p.chunk_rows == 3 for p in plans)
    assert [(o.chunk_size, o.accum_dtype, o.temperature, o.softcap, o.logit_scale) for o in options] == [
        (3, None, temperature, softcap, scale)]
    h64, w64 = hidden.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    z = softcap * torch.tanh(scale * (h64 @ w64.T) / softcap) / temperature
    want = torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)
    (want * a.double()).sum().backward()
    assert rel_err(lp, want) <= 1e-5
    assert rel_err(hidden.grad, h64.grad) <= 1e-5 and rel_err(w.grad, w64.grad) <= 1e-5


def test_unpatched_models_keep_trls_own_head(monkeypatch):
    """Only the patched model's lm_head is routed to our kernels; another model in the same process is not."""
    patched, other = make_model("llama"), make_model("llama", seed=1)
    fused_lm_loss.patch(patched)
    from trl.trainer.utils import _ChunkedLogProbFunction

    assert _ChunkedLogProbFunction is trl_integration.FusedLogProbs
    calls = []
    original = trl_integration.token_stats_with
    monkeypatch.setattr(trl_integration, "token_stats_with", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(trl_integration, "_warned", set())
    hidden = torch.randn(10, 32)
    targets = torch.randint(0, VOCAB, (10,))
    for model, expected_calls in ((other, 0), (patched, 1)):
        w = model.get_output_embeddings().weight
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            out = _ChunkedLogProbFunction.apply(hidden, w, None, targets, 1.0, 32768, None, 1.0,
                                                ("log_probs", "entropy"))
        want = torch.log_softmax(hidden @ w.T, -1).gather(1, targets[:, None]).squeeze(1)
        assert rel_err(out[0], want) <= 1e-6 and len(calls) == expected_calls
        # the unpatched one beside a patched one (a reference model the trainer built) is said, once
        assert [str(w.message) for w in said if "not patched" in str(w.message)] != [] if model is other else not said


def test_a_trl_whose_trainers_do_not_import_is_left_alone_with_a_warning(monkeypatch):
    """TRL installed beside a transformers it does not support (its trainer module raises ImportError): patch()
    still patches the model, and warns that TRL's head is not replaced (TRL's trainers cannot run there)."""
    monkeypatch.setattr(trl_integration, "_trl_function", None)
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", None)  # (an import of it raises ImportError)
    model = make_model("llama")
    with pytest.warns(UserWarning, match="its trainers do not import"):
        fused_lm_loss.patch(model)
    assert trl_integration._trl_function is None
    batch = {"input_ids": torch.randint(0, VOCAB, (2, 6))}
    assert torch.isfinite(model(**batch, labels=batch["input_ids"]).loss)


def test_copies_and_reassigned_losses_route_trls_head_as_the_model_trains(monkeypatch):
    """A deepcopy of a patched model (a reference model) runs our kernels under TRL's head as the original does;
    a patched model whose loss_function is another callable (it computes logits, as unpatched) gets TRL's own."""
    import copy

    patched = fused_lm_loss.patch(make_model("llama"))
    clone = copy.deepcopy(patched)
    reassigned = fused_lm_loss.patch(make_model("llama", seed=1))
    reassigned.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().mean()
    from trl.trainer.utils import _ChunkedLogProbFunction

    calls = []
    original = trl_integration.token_stats_with
    monkeypatch.setattr(trl_integration, "token_stats_with", lambda *a, **k: calls.append(1) or original(*a, **k))
    hidden, targets = torch.randn(10, 32), torch.randint(0, VOCAB, (10,))
    for model, ours in ((clone, 1), (reassigned, 0)):
        w = model.get_output_embeddings().weight
        out = _ChunkedLogProbFunction.apply(hidden, w, None, targets, 1.0, 32768, None, 1.0, ("log_probs", "entropy"))
        want = torch.log_softmax(hidden @ w.T, -1).gather(1, targets[:, None]).squeeze(1)
        assert rel_err(out[0], want) <= 1e-6 and len(calls) == ours
        calls.clear()


def test_outputs_we_do_not_compute_fall_back_with_a_warning_per_trainer(monkeypatch):
    """An output we do not compute (one a later TRL might add) runs TRL's own head, with a warning that names the
    output and the trainer: once per trainer and reason, so that one trainer's warning does not silence another's."""
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_integration, "_warned", set())
    model = fused_lm_loss.patch(make_model("llama"))
    w = model.get_output_embeddings().weight
    hidden, targets = torch.randn(4, 32), torch.randint(0, VOCAB, (4,))

    def call(self):
        return trl_utils._ChunkedLogProbFunction.apply(hidden, w, None, targets, 1.0, 32768, None, 1.0,
                                                       ("log_probs", "top_k_probs"))

    trainers = [type(name, (), {"__module__": "trl.trainer.fake", "step": call}) for name in ("DPOTrainer",
                                                                                              "KTOTrainer")]
    for trainer in trainers:
        with pytest.warns(UserWarning, match=rf"top_k_probs.*\({trainer.__name__}\)"):
            out = trainer().step()
        want = torch.log_softmax(hidden @ w.T, -1).gather(1, targets[:, None]).squeeze(1)
        assert rel_err(out[0], want) <= 1e-6  # TRL's own head computed it
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainers[0]().step()  # the same trainer and reason again: no second warning


def test_dpo_and_kto_calls_of_trls_head_match_trls_outputs_and_gradients():
    """DPO's / KTO's calls (mean_logits, log_sum_sq_probs, is_top1; per-sequence weights on the log-probabilities)
    give TRL's own outputs and gradients, trainable and frozen head, with TRL's temperature, softcap and scale."""
    import trl.trainer.utils as trl_utils

    outputs_of = {"dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
                  "dpo_wpo": ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),
                  "kto": ("log_probs", "entropy", "mean_logits")}
    for name, outputs in outputs_of.items():
        for frozen in (False, True):
            model = fused_lm_loss.patch(make_model("llama"))
            ours = trl_utils._ChunkedLogProbFunction
            assert ours is trl_integration.FusedLogProbs
            w = model.get_output_embeddings().weight
            w.requires_grad_(not frozen)
            hidden, targets = torch.randn(14, 32), torch.randint(0, VOCAB, (14,))
            a = torch.repeat_interleave(torch.randn(2), 7)  # one weight per sequence, as DPO's sigmoid loss gives
            results = []
            for fn in (trl_integration._trl_function, ours):
                h = hidden.clone().requires_grad_(True)
                w.grad = None
                out = fn.apply(h, w, None, targets, 0.8, 32768, 6.0, 1.3, outputs)
                (out[0] * a).sum().backward()
                results.append((out, h.grad, None if frozen else w.grad.clone()))
            (want, h0, w0), (got, h1, w1) = results
            for field, g, x in zip(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), got, want):
                assert (g is None) == (x is None), (name, field)
                if x is not None and x.dtype == torch.bool:
                    assert torch.equal(g, x), (name, field)
                elif x is not None:
                    assert not (field in ("log_sum_sq_probs", "mean_logits") and g.requires_grad), (name, field)
                    assert rel_err(g, x) <= 1e-5, (name, field)
            assert rel_err(h1, h0) <= 1e-5 and (frozen or rel_err(w1, w0) <= 1e-5), name


def test_trl_0x_sft_trainer_gets_a_clear_error(monkeypatch):
    """TRL 0.x's SFTTrainer computes metrics from outputs.logits, which a patched model does not make: a clear
    error at the first step instead of TRL's AttributeError. (A stand-in for TRL 0.29.1's call chain.)"""
    from .hf_models import make_batch

    fake = types.ModuleType("trl")
    fake.__version__ = "0.29.1"
    monkeypatch.setitem(sys.modules, "trl", fake)
    model = fused_lm_loss.patch(make_model("llama"))
    namespace = {"model": model, "batch": make_batch()}
    code = compile("def compute_loss():\n    return model(**batch)\n", "/site-packages/trl/trainer/sft_trainer.py", "exec")
    exec(code, namespace)
    with pytest.raises(RuntimeError, match="outputs.logits"):
        namespace["compute_loss"]()
    assert model(**make_batch()).loss is not None  # called from anywhere else: trains as usual


def test_unsupported_trl_version_fails_loudly(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.99.0")
    monkeypatch.setattr(trl_integration, "_trl_function", None)
    with pytest.raises(RuntimeError, match="1.99.0"):
        fused_lm_loss.patch(make_model("llama"))


def test_trainer_label_smoothing_factor_warns(tmp_path):
    """Trainer(label_smoothing_factor > 0) withholds the labels from the model and smooths full logits itself:
    the fused loss does not run, and the patched model says so."""
    from .test_trainer import _dataset

    model = fused_lm_loss.patch(make_model("llama"))
    config = transformers.TrainingArguments(
        output_dir=str(tmp_path / "smooth"), per_device_train_batch_size=2, max_steps=1, report_to=[],
        save_strategy="no", use_cpu=TEST_DEVICE == "cpu", label_smoothing_factor=0.1, dataloader_pin_memory=False,
    )
    with pytest.warns(UserWarning, match="label_smoothing_factor"):
        transformers.Trainer(model=model, args=config, train_dataset=_dataset()).train()


def test_rl_call_of_trls_head_matches_trls_gradients():
    """GRPO-style calls of TRL's head (log-probs and entropy, per-token advantages and an entropy bonus) give
    TRL's own outputs and gradients, trainable and frozen head."""
    import trl.trainer.utils as trl_utils

    for frozen in (False, True):
        model = fused_lm_loss.patch(make_model("llama"))
        ours = trl_utils._ChunkedLogProbFunction  # (looked up after patch(), as TRL looks it up at each call)
        assert ours is trl_integration.FusedLogProbs
        w = model.get_output_embeddings().weight
        w.requires_grad_(not frozen)
        hidden = torch.randn(14, 32)
        targets = torch.randint(0, VOCAB, (14,))
        a, b = torch.randn(14), torch.randn(14)
        results = []
        for fn in (trl_integration._trl_function, ours):
            h = hidden.clone().requires_grad_(True)
            w.grad = None
            lp, entropy, *_ = fn.apply(h, w, None, targets, 0.8, 32768, None, 1.0, ("log_probs", "entropy"))
            ((lp * a).sum() + (entropy * b).sum()).backward()
            results.append((lp.detach(), entropy.detach(), h.grad, None if frozen else w.grad.clone()))
        (lp0, e0, h0, w0), (lp1, e1, h1, w1) = results
        assert rel_err(lp1, lp0) <= 1e-5 and rel_err(e1, e0) <= 1e-5 and rel_err(h1, h0) <= 1e-5
        assert frozen or rel_err(w1, w0) <= 1e-5


def test_rl_call_with_kept_logits(monkeypatch):
    """A patched model's FusedLMLoss(keep_logits=True) reaches TRL's RL calls: the trainable head's backward reads
    the logits kept in forward (no logits matmul), and the outputs and gradients are still TRL's own."""
    import fused_lm_loss.chunked as chunked
    import trl.trainer.utils as trl_utils

    model = fused_lm_loss.patch(make_model("llama"), fused_lm_loss.FusedLMLoss(keep_logits=True))
    ours = trl_utils._ChunkedLogProbFunction
    assert ours is trl_integration.FusedLogProbs
    w = model.get_output_embeddings().weight
    hidden, targets = torch.randn(14, 32), torch.randint(0, VOCAB, (14,))
    a, b = torch.randn(14), torch.randn(14)
    matmuls = []
    into = chunked.logits_into
    monkeypatch.setattr(chunked, "logits_into", lambda *args: matmuls.append(1) or into(*args))
    results = []
    for fn in (trl_integration._trl_function, ours):
        h = hidden.clone().requires_grad_(True)
        w.grad = None
        lp, entropy, *_ = fn.apply(h, w, None, targets, 0.8, 32768, None, 1.0, ("log_probs", "entropy"))
        forward_matmuls = len(matmuls)
        ((lp * a).sum() + (entropy * b).sum()).backward()
        if fn is ours:
            assert forward_matmuls == 1 and len(matmuls) == 1  # ours: one logits matmul, in forward
        results.append((lp.detach(), entropy.detach(), h.grad, w.grad.clone()))
    for got, want in zip(results[1], results[0]):
        assert rel_err(got, want) <= 1e-5


def _word_tokenizer():
    """The tiny vocabulary, words split at spaces ("t5 t9 t2"), for TRL's text datasets."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    fast = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    fast.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=fast, pad_token="t0", eos_token="t2", unk_token="t1")


def _words(g, low, high) -> str:
    n = int(torch.randint(low, high, (1,), generator=g, device="cpu"))
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g, device="cpu"))


def _preference_rows(trainer: str, n: int, seed: int) -> list:
    g = torch.Generator("cpu").manual_seed(seed)
    rows = []
    for i in range(n):
        prompt = _words(g, 2, 6)
        if trainer == "dpo":
            rows.append({"prompt": prompt, "chosen": f" {_words(g, 2, 6)} t2", "rejected": f" {_words(g, 2, 6)} t2"})
        else:
            rows.append({"prompt": prompt, "completion": f" {_words(g, 2, 6)} t2", "label": i % 2 == 0})
    return rows


def _train_preference(tmp_path, trainer: str, *, impl: str, lora: bool = False, monkeypatch=None, **config):
    """3 steps of TRL's DPOTrainer / KTOTrainer (fp32, SGD), impl "trl" (TRL's own head) or "patched" (ours).
    Returns (log history, final parameters, our kernel calls)."""
    model = make_model("llama")
    ref_model, peft_config = None, None
    if lora:  # (the reference: the same model with the adapter disabled)
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    else:
        ref_model = make_model("llama")
    if impl == "patched":
        for m in (model, ref_model):
            if m is not None:
                fused_lm_loss.patch(m)
    config_class, trainer_class = (trl.DPOConfig, trl.DPOTrainer) if trainer == "dpo" else (trl.KTOConfig,
                                                                                           trl.KTOTrainer)
    args = config_class(
        output_dir=str(tmp_path / f"{trainer}_{impl}"), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
        eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=4, report_to=[], save_strategy="no",
        use_cpu=TEST_DEVICE == "cpu", seed=0, learning_rate=0.5, dataloader_pin_memory=False, bf16=False,
        optim="sgd", **config,
    )
    built = trainer_class(
        model=model, ref_model=ref_model, args=args, train_dataset=datasets.Dataset.from_list(_preference_rows(trainer, 12, 0)),
        eval_dataset=datasets.Dataset.from_list(_preference_rows(trainer, 4, 1)), processing_class=_word_tokenizer(),
        peft_config=peft_config,
    )
    return _trained(built, monkeypatch, "token_stats_with")


@pytest.mark.parametrize("trainer,config", [
    ("dpo", dict()), ("dpo", dict(use_weighting=True)), ("kto", dict()),
], ids=["dpo", "dpo_wpo", "kto"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_preference_trainers_run_our_kernels_with_trls_numbers(tmp_path, monkeypatch, trainer, config, lora):
    """DPO (with and without WPO weighting) and KTO ask TRL's head for mean_logits (and log_sum_sq_probs): our
    kernels serve every call, with no fallback, and every logged metric (rewards/*, logps/*, logits/*, entropy,
    token accuracy) and the trained parameters equal TRL's own head's to fp32 round-off."""
    import warnings

    want = _train_preference(tmp_path, trainer, impl="trl", lora=lora, **config)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*TRL's own fused LM head runs.*")
        got = _train_preference(tmp_path, trainer, impl="patched", lora=lora, monkeypatch=monkeypatch, **config)
    assert got[2] > 0
    logged = set().union(*(log.keys() for log in got[0]))
    assert any(key.startswith("logits/") for key in logged), sorted(logged)
    assert_same_training(*got[:2], *want[:2])


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.4])
@pytest.mark.parametrize("head", ["trainable", "frozen"])
def test_distillation_divergence_matches_trls(monkeypatch, beta, head):
    """The distillation trainer's divergence call on a patched student: TRL's own per-token divergence, entropy and
    student gradients (the trainer's mean, and per-token weights), with each side's scale / softcap and a
    temperature; a teacher of another hidden size; an unpatched student keeps TRL's function."""
    import trl.trainer.distillation_trainer as distillation

    student = fused_lm_loss.patch(make_model("llama"))
    ours = distillation.ChunkedDivergenceFunction
    assert ours is trl_integration.FusedDivergenceFunction
    sw = student.get_output_embeddings().weight
    sw.requires_grad_(head == "trainable")
    hidden, teacher_hidden = torch.randn(17, 32), torch.randn(17, 48)
    teacher_weight = torch.randn(VOCAB, 48) / 4
    for weights in (torch.full((17,), 1 / 17), torch.randn(17)):
        results = []
        for fn in (trl_integration._trl_divergence, ours):
            h = hidden.clone().requires_grad_(True)
            sw.grad = None
            div, entropy = fn.apply(h, sw, None, teacher_hidden, teacher_weight, None, beta, 0.8, 1.2, 6.0, 0.9, None)
            (div * weights).sum().backward()
            results.append((div.detach(), entropy, h.grad, None if sw.grad is None else sw.grad.clone()))
        (d0, e0, h0, w0), (d1, e1, h1, w1) = results
        assert rel_err(d1, d0) <= 1e-5 and rel_err(e1, e0) <= 1e-5 and rel_err(h1, h0) <= 1e-5
        assert (w0 is None) == (head == "frozen") and (w0 is None or rel_err(w1, w0) <= 1e-5)
    other = make_model("llama", seed=1)
    calls = []
    trls = trl_integration._trl_divergence
    monkeypatch.setattr(trl_integration, "_trl_divergence",
                        types.SimpleNamespace(apply=lambda *a: calls.append(1) or trls.apply(*a)))
    ours.apply(hidden, other.get_output_embeddings().weight, None, teacher_hidden, teacher_weight, None, beta)
    assert calls == [1]


@pytest.mark.parametrize("options", [
    dict(label_smoothing=0.1), dict(z_loss=1e-4), dict(temperature=0.5), dict(ignore_index=-1),
    dict(reduction="sum"), dict(accum_dtype=None), dict(keep_logits=True),
], ids=lambda o: next(iter(o)))
def test_every_option_the_distillation_divergence_cannot_honour_raises(options):
    """A patched student's FusedLMLoss options reach TRL's distillation call: what the divergence cannot honour
    raises there, naming it (it was silently dropped)."""
    import trl.trainer.distillation_trainer as distillation

    student = fused_lm_loss.patch(make_model("llama"), fused_lm_loss.FusedLMLoss(**options))
    with pytest.raises(ValueError, match=next(iter(options))):
        distillation.ChunkedDivergenceFunction.apply(torch.randn(4, 32), student.get_output_embeddings().weight,
                                                     None, torch.randn(4, 48), torch.randn(VOCAB, 48), None, 0.5)


def test_the_students_chunk_size_reaches_the_distillation_divergence(monkeypatch):
    """The patched student's chunk_size (a memory cap) sizes the divergence's chunks; the numbers stay TRL's."""
    import trl.trainer.distillation_trainer as distillation

    seen = []
    divergence_with = trl_integration.divergence_with
    monkeypatch.setattr(trl_integration, "divergence_with",
                        lambda opts, *a, **k: seen.append(opts.chunk_size) or divergence_with(opts, *a, **k))
    student = fused_lm_loss.patch(make_model("llama"), fused_lm_loss.FusedLMLoss(chunk_size=3))
    sw = student.get_output_embeddings().weight
    hidden, teacher_hidden, teacher_weight = torch.randn(10, 32), torch.randn(10, 48), torch.randn(VOCAB, 48) / 4
    results = []
    for fn in (trl_integration._trl_divergence, distillation.ChunkedDivergenceFunction):
        h = hidden.clone().requires_grad_(True)
        sw.grad = None
        div, _ = fn.apply(h, sw, None, teacher_hidden, teacher_weight, None, 0.5, 0.8)
        div.mean().backward()
        results.append((div.detach(), h.grad, sw.grad.clone()))
    assert seen == [3]
    for got, want in zip(results[1], results[0]):
        assert rel_err(got, want) <= 1e-5


def _distill(tmp_path, *, impl: str, beta: float, monkeypatch=None):
    """2 steps of TRL's DistillationTrainer (on-policy: the student generates), fp32, SGD; impl "trl" or "patched"
    (the student patched). Returns (log history, final parameters, our divergence calls)."""
    student, teacher = make_model("llama"), make_model("llama", seed=3)
    if impl == "patched":
        fused_lm_loss.patch(student)
    args = trl.DistillationConfig(
        output_dir=str(tmp_path / f"distill_{impl}"), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=TEST_DEVICE == "cpu", seed=0, learning_rate=0.5,
        dataloader_pin_memory=False, bf16=False, optim="sgd", beta=beta, max_completion_length=6, temperature=0.9,
    )
    rows = [{"prompt": " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (5,)))} for _ in range(8)]
    trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                      train_dataset=datasets.Dataset.from_list(rows), processing_class=_word_tokenizer())
    with torch.device("cpu"):  # (TRL's RepeatSampler draws from a CPU generator: not under a CUDA default device)
        return _trained(trainer, monkeypatch, "divergence_with")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_trainer_runs_our_kernels_with_trls_numbers(tmp_path, monkeypatch, beta):
    want = _distill(tmp_path, impl="trl", beta=beta)
    got = _distill(tmp_path, impl="patched", beta=beta, monkeypatch=monkeypatch)
    assert got[2] > 0
    assert_same_training(*got[:2], *want[:2])
