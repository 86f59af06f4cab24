"""patch() on tiny random Hugging Face causal LMs: loss and every gradient equal the unpatched model."""
from __future__ import annotations

import copy
import functools
import importlib
import inspect
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fused_lm_loss
from fused_lm_loss import FusedLMLoss
from fused_lm_loss.integrations import causal_lm_loss

from ..conftest import requires_triton

transformers = pytest.importorskip("transformers")
import transformers.loss.loss_utils  # noqa: E402

from .hf_models import FAMILIES, VOCAB, assert_close_grads, grads, make_batch, make_model, rel_err, twin  # noqa: E402


def _train_step(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, grads(model)


def _trains_as_unpatched(model, ref, batch):
    """One training step of the patched model and of its unpatched twin: no logits, the same loss and gradients.
    Returns both outputs."""
    out, got = _train_step(model, **batch)
    want_out, want = _train_step(ref, **batch)
    assert out.logits is None
    assert rel_err(out.loss.detach(), want_out.loss.detach()) <= 2e-4
    assert_close_grads(got, want)
    return out, want_out


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_unpatched(family):
    model = make_model(family)
    ref = twin(model)
    try:
        fused_lm_loss.patch(model)
    except TypeError as error:  # transformers 4.x: some families still compute their loss inline
        if "self.loss_function" in str(error) and transformers.__version__.startswith("4."):
            pytest.skip(str(error))
        raise
    batch = make_batch()
    out, want_out = _trains_as_unpatched(model, ref, batch)
    if family in ("mixtral", "qwen3_moe"):  # router aux loss reached the fused loss
        assert out.aux_loss is not None
        assert rel_err(out.aux_loss.detach(), want_out.aux_loss.detach()) <= 2e-4

    model.eval()
    ref.eval()
    with torch.no_grad():
        got_eval, want_eval = model(**batch), ref(**batch)
    assert torch.equal(got_eval.logits, want_eval.logits)
    assert torch.equal(got_eval.loss, want_eval.loss)


def test_tied_embeddings_gradient_reaches_embedding():
    model = make_model("llama_tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = twin(model)
    fused_lm_loss.patch(model)
    _, got = _train_step(model, **make_batch())
    _, want = _train_step(ref, **make_batch())
    assert_close_grads(got, want)  # one shared parameter: lm_head and embedding gradients summed


@requires_triton
def test_triton_interpreter_backend():
    model = make_model("gemma2")
    ref = twin(model)
    fused_lm_loss.patch(model)
    with fused_lm_loss.use_backend("triton"):
        out, got = _train_step(model, **make_batch(seq=8))
    want_out, want = _train_step(ref, **make_batch(seq=8))
    assert rel_err(out.loss.detach(), want_out.loss.detach()) <= 2e-4
    assert_close_grads(got, want)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items_in_batch(as_tensor):
    model = make_model()
    ref = twin(model)
    fused_lm_loss.patch(model)
    n = torch.tensor(37) if as_tensor else 37
    out, got = _train_step(model, **make_batch(), num_items_in_batch=n)
    want_out, want = _train_step(ref, **make_batch(), num_items_in_batch=n)
    assert rel_err(out.loss.detach(), want_out.loss.detach()) <= 2e-4
    assert_close_grads(got, want)


@pytest.mark.skipif(
    not hasattr(transformers.loss.loss_utils, "fixed_cross_entropy")
    or "shift_labels" not in inspect.signature(transformers.loss.loss_utils.ForCausalLMLoss).parameters,
    reason="this transformers has no shift_labels / logits_to_keep",
)
def test_shift_labels_and_logits_to_keep():
    model = make_model()
    ref = twin(model)
    fused_lm_loss.patch(model)
    batch = make_batch()
    shift = torch.randint(0, VOCAB, (2, 5))
    shift[1, 0] = -100
    kwargs = dict(batch, shift_labels=shift, logits_to_keep=5)
    out, got = _train_step(model, **kwargs)
    want_out, want = _train_step(ref, **kwargs)
    assert rel_err(out.loss.detach(), want_out.loss.detach()) <= 2e-4
    assert_close_grads(got, want)


def test_positional_labels_and_tuple_output():
    model = make_model()
    ref = twin(model)
    fused_lm_loss.patch(model)
    batch = make_batch()
    # LlamaForCausalLM.forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, ...)
    labels_pos = list(inspect.signature(ref.forward).parameters).index("labels")
    args = [batch["input_ids"]] + [None] * (labels_pos - 1) + [batch["labels"]]
    out = model(*args, return_dict=False)
    want = ref(*args, return_dict=False)
    assert len(out) == len(want) - 1  # the logits are left out, as transformers leaves out None
    assert rel_err(out[0].detach(), want[0].detach()) <= 2e-4


def test_generate_and_no_labels_unchanged():
    model = make_model()
    ref = twin(model)
    fused_lm_loss.patch(model)
    ids = make_batch()["input_ids"][:, :5]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    # generation in training mode (GRPO, distillation): no grad, so no training loss and no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    with pytest.warns(UserWarning, match="training mode without labels"):
        out = model(input_ids=ids)  # training mode, no labels, with autograd: original forward, and a warning
    assert torch.equal(out.logits, ref(input_ids=ids).logits)
    model.eval()
    ref.eval()
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))


def test_unpatch_restores_everything():
    model = make_model()
    cls, forward = type(model), model.forward
    fused_lm_loss.patch(model)
    assert type(model).__name__ == cls.__name__  # save_pretrained records the real architecture
    assert "input_ids" in inspect.signature(model.forward).parameters  # Trainer keeps its columns
    assert any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    fused_lm_loss.unpatch(model)
    assert type(model) is cls and "forward" not in vars(model) and model.forward == forward
    assert model(**make_batch()).logits is not None
    with pytest.raises(RuntimeError, match="not patched"):
        fused_lm_loss.unpatch(model)


def test_deepcopy_of_patched_model_is_independent():
    model = fused_lm_loss.patch(make_model())
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.lm_head.weight.add_(1.0)
    assert clone(**make_batch()).loss != model(**make_batch()).loss


def _smoothed_reference(model, batch, smoothing):
    logits = model(input_ids=batch["input_ids"]).logits
    targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=smoothing)


def test_loss_function_assignment_on_patched_model():
    model = make_model("gemma2")
    ref = twin(model)
    fused_lm_loss.patch(model)
    loss_fn = FusedLMLoss(label_smoothing=0.1)
    model.loss_function = loss_fn
    assert model.loss_function is loss_fn and "loss_function" not in model._modules
    batch = make_batch()
    out, got = _train_step(model, **batch)
    ref.zero_grad()
    want_loss = _smoothed_reference(ref, batch, 0.1)  # softcap comes from the config
    want_loss.backward()
    assert rel_err(out.loss.detach(), want_loss.detach()) <= 2e-4
    assert_close_grads(got, grads(ref))
    model.eval()  # eval: the same loss on the materialized logits
    assert rel_err(model(**batch).loss.detach(), want_loss.detach()) <= 2e-4


def test_loss_function_assignment_on_unpatched_model_patches_it():
    model = make_model()
    ref = twin(model)
    model.loss_function = FusedLMLoss(label_smoothing=0.2)  # transformers alone would ignore this
    assert fused_lm_loss.integrations.is_patched(model)
    batch = make_batch()
    out = model(**batch)
    assert out.logits is None
    assert rel_err(out.loss.detach(), _smoothed_reference(ref, batch, 0.2).detach()) <= 2e-4
    fused_lm_loss.unpatch(model)
    assert "loss_function" not in model._modules


def test_other_callable_loss_function_gets_logits():
    model = fused_lm_loss.patch(make_model())
    seen = []

    def my_loss(logits, labels, vocab_size, **kwargs):
        seen.append(logits.shape)
        return logits.float().logsumexp(-1).mean()

    model.loss_function = my_loss
    out = model(**make_batch())
    assert seen == [(2, 12, VOCAB)] and out.logits is not None


def test_an_unpickled_loss_assigned_takes_effect():
    """A FusedLMLoss that arrives pickled (torch.load, another process) is made without __init__: in a fresh
    interpreter that never built one, assigning it still patches the model (the hook is installed on unpickling)."""
    import pickle
    import subprocess
    import sys

    code = (
        "import pickle, sys\n"
        "from tests.integrations.hf_models import make_model\n"
        "from fused_lm_loss.integrations.hf_patch import is_patched, patched_options\n"
        "model = make_model()\n"
        "model.loss_function = pickle.loads(sys.stdin.buffer.read())\n"
        "print(is_patched(model), patched_options(model).label_smoothing)\n"
    )
    pickled = pickle.dumps(FusedLMLoss(label_smoothing=0.3))
    run = subprocess.run([sys.executable, "-c", code], input=pickled, capture_output=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.stdout.decode().split() == ["True", "0.3"], run.stderr.decode()[-2000:]


@pytest.mark.parametrize("wrapper", ["lora_model", "data_parallel"])
def test_loss_assigned_through_a_wrapper_takes_effect(wrapper):
    """``wrapper.loss_function = FusedLMLoss(...)`` on peft's tuner (LoraModel, what ``peft_model.base_model`` is)
    or on torch's DataParallel reaches the transformers model inside, not a child module nobody calls."""
    model = make_model()
    ref = twin(model)
    if wrapper == "lora_model":
        import peft

        outer = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
        ref = peft.get_peft_model(ref, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
        ref.load_state_dict(outer.state_dict())
        wrapped = outer.base_model
    else:
        outer = wrapped = torch.nn.DataParallel(model)
    wrapped.loss_function = FusedLMLoss(label_smoothing=0.3)
    assert fused_lm_loss.integrations.is_patched(model)
    batch = make_batch()
    assert rel_err(outer(**batch).loss.detach(), _smoothed_reference(ref, batch, 0.3).detach()) <= 2e-4


def test_contradicting_softcap_is_rejected():
    model = fused_lm_loss.patch(make_model("gemma2"))
    with pytest.raises(ValueError, match="softcap"):
        model.loss_function = FusedLMLoss(softcap=50.0)


def test_grad_scaler_scale_reaches_the_loss():
    class CountingScaler:
        calls = 0

        def get_scale(self):
            self.calls += 1
            return 1024.0

    scaler = CountingScaler()
    model = make_model()
    ref = twin(model)
    fused_lm_loss.patch(model, grad_scaler=scaler)
    batch = make_batch()
    (model(**batch).loss * 1024.0).backward()  # what scaler.scale(loss).backward() does
    _, want = _train_step(ref, **batch)
    assert scaler.calls == 1
    assert_close_grads({n: g / 1024.0 for n, g in grads(model).items()}, want)


def test_transformers_loss_signature_on_logits():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 7))
    labels[0, 2] = -100
    from transformers.loss.loss_utils import ForCausalLMLoss

    want = ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=torch.tensor(9))
    (want_grad,) = torch.autograd.grad(want, logits)
    opts = FusedLMLoss().options
    got = causal_lm_loss(opts, logits, labels, VOCAB, num_items_in_batch=torch.tensor(9))
    (got_grad,) = torch.autograd.grad(got, logits)
    assert rel_err(got.detach(), want.detach()) <= 1e-5
    assert rel_err(got_grad, want_grad) <= 1e-5
    half = logits.detach().bfloat16().requires_grad_()
    causal_lm_loss(opts, half, labels, VOCAB).backward()
    assert half.grad.dtype == torch.bfloat16  # no fp32 copy of the logits is kept
    with pytest.raises(TypeError, match="signature"):  # FusedLMLoss itself takes hidden states only
        FusedLMLoss()(logits, labels, VOCAB)


def test_unsupported_models_raise_naming_the_class():
    from transformers import LlamaModel

    with pytest.raises(TypeError, match="LlamaModel"):
        fused_lm_loss.patch(LlamaModel(make_model().config))

    class DoubledLogits(type(make_model())):  # a forward that scales logits unknown to the config
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state) * 2.0
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
            return transformers_output(loss=loss, logits=logits)

    from transformers.modeling_outputs import CausalLMOutput as transformers_output

    model = DoubledLogits(make_model().config).train()
    fused_lm_loss.patch(model)
    with pytest.raises(RuntimeError, match="DoubledLogits"):
        model(**make_batch())


def test_a_forward_passing_its_logits_width_as_vocab_size():
    """Inkling's forward passes ``vocab_size=logits.shape[-1]``: under the patch, the probe's width, which stands for
    the lm_head's rows (the width of its unpatched logits)."""

    class WidthAsVocab(type(make_model())):
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
            loss = self.loss_function(logits, labels, vocab_size=logits.shape[-1], **kwargs)
            return transformers_output(loss=loss, logits=logits)

    from transformers.modeling_outputs import CausalLMOutput as transformers_output

    model = WidthAsVocab(make_model().config).train()
    ref = twin(model)
    fused_lm_loss.patch(model)
    _trains_as_unpatched(model, ref, make_batch())


@pytest.mark.parametrize("how", ["subclass", "hook", "hook_after"])
def test_a_loss_whose_module_call_would_be_skipped_is_refused(how):
    """A patched model uses a FusedLMLoss's options only (the loss is made inside lm_head's call): a subclass's
    forward, or a forward hook, would silently never run, so they raise (also a hook added after assigning)."""

    class Doubled(FusedLMLoss):
        def forward(self, *args, **kwargs):
            return 2.0 * super().forward(*args, **kwargs)

    model = make_model()
    loss = Doubled() if how == "subclass" else FusedLMLoss()
    if how == "hook":
        loss.register_forward_hook(lambda module, args, out: out * 2.0)
    if how != "hook_after":
        with pytest.raises(ValueError, match="uses only a FusedLMLoss's options"):
            model.loss_function = loss
        with pytest.raises(ValueError, match="uses only a FusedLMLoss's options"):
            fused_lm_loss.patch(make_model(), loss)
        return
    model.loss_function = loss
    loss.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match="forward hooks"):
        model(**make_batch())


def test_accelerate_device_map_offloaded_head(tmp_path):
    """A model loaded with ``device_map`` (accelerate's hook on lm_head moves its input and loads an offloaded
    weight): the patched training forward runs that hook around the fused loss, and matches the unpatched one."""
    pytest.importorskip("accelerate")
    make_model().save_pretrained(tmp_path / "model")
    losses, input_grads = [], []
    for patched in (False, True):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "model", device_map={"model": "cpu", "lm_head": "disk"}, offload_folder=tmp_path / "offload",
            dtype=torch.float32,
        ).train()
        if patched:
            fused_lm_loss.patch(model)
        out = model(**make_batch())
        out.loss.backward()
        losses.append(out.loss.detach())
        input_grads.append(model.model.embed_tokens.weight.grad)
    assert rel_err(losses[1], losses[0]) <= 2e-5
    assert rel_err(input_grads[1], input_grads[0]) <= 2e-4


@pytest.mark.parametrize("changes_labels", [False, True])
def test_a_forward_wrapper_that_passes_copies_of_the_labels(changes_labels):
    """accelerate's hook on a ``device_map`` model moves the forward's inputs to the execution device, so on a GPU
    machine a batch on CUDA reaches loss_function as copies: equal copies are accepted (the patched model trains as
    the unpatched one with the same hook), copies with other values are refused, never used silently."""
    hooks = pytest.importorskip("accelerate.hooks")

    class CopyLabels(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            labels = kwargs["labels"].clone()
            if changes_labels:
                labels[labels >= 0] = (labels[labels >= 0] + 1) % VOCAB
            return args, {**kwargs, "labels": labels}

    model = make_model()
    ref = twin(model)
    for m in (model, ref):
        hooks.add_hook_to_module(m, CopyLabels())
    fused_lm_loss.patch(model)
    if changes_labels:
        with pytest.raises(RuntimeError, match="changes the labels"):
            model(**make_batch())
    else:
        _trains_as_unpatched(model, ref, make_batch())


def _replicate(model, monkeypatch, n=2):
    """``torch.nn.parallel.replicate`` (what DataParallel runs on several GPUs) on this CPU: the GPU broadcast of the
    parameters replaced by copies that keep their autograd link to the originals, as the broadcast's do."""
    replicate = importlib.import_module("torch.nn.parallel.replicate")
    monkeypatch.setattr(replicate, "_broadcast_coalesced_reshape",
                        lambda tensors, devices, detach=False: [[t * 1.0 for t in tensors] for _ in devices])
    return replicate.replicate(model, list(range(n)))


def test_data_parallel_replicas_train_with_their_own_weights(monkeypatch):
    """Each DataParallel replica of a patched model runs its own (broadcast) weights with a patch state of its own,
    as the unpatched model's replicas do: the same losses, and the same gradients reach the original parameters.
    (A replica's copied forward ran the original's modules, and the copy itself raised a KeyError.)"""
    model = make_model()
    ref = twin(model)
    fused_lm_loss.patch(model)
    batch = make_batch()
    results = []
    for m in (model, ref):
        replicas = _replicate(m, monkeypatch)
        with torch.no_grad():
            replicas[1].lm_head.weight.mul_(20.0)  # replica 1 must see its own head
        losses = [r(**batch).loss for r in replicas]
        sum(losses).backward()
        results.append((losses, grads(m)))
    (got, got_grads), (want, want_grads) = results
    assert abs(got[1].item() - got[0].item()) > 0.05
    for a, b in zip(got, want):
        assert rel_err(a.detach(), b.detach()) <= 2e-5
    assert_close_grads(got_grads, want_grads)


@pytest.mark.parametrize("mode", ["eval", "train_without_labels"])
def test_data_parallel_replicas_use_their_own_head_off_the_fused_path(monkeypatch, mode):
    """An eval or label-free forward of a replica (Trainer.evaluate under DataParallel) runs the replica's lm_head,
    as unpatched: the replica's copy of the original's head wrapper ran the original's head there."""
    model = make_model()
    ref = twin(model)
    fused_lm_loss.patch(model)
    batch = {k: v for k, v in make_batch().items() if k != "labels"}
    results = []
    for m in (model, ref):
        m.train(mode != "eval")
        replicas = _replicate(m, monkeypatch)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the patched model says it was called in training without labels)
            replicas[1].lm_head.weight.mul_(20.0)  # replica 1 must see its own head
            results.append([r(**batch).logits for r in replicas])
    (got, want) = results
    assert not torch.allclose(want[0], want[1])
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-6


def test_data_parallel_refuses_a_forward_it_cannot_rebind(monkeypatch):
    """A forward wrapped after patch() (accelerate's mixed-precision wrapper) is bound to the original: its replica
    would run the original's modules, so replicating raises, naming DistributedDataParallel."""
    model = make_model()
    fused_lm_loss.patch(model)
    model.forward = functools.partial(model.forward)
    with pytest.raises(RuntimeError, match="DataParallel cannot replicate"):
        _replicate(model, monkeypatch)


def test_one_lm_head_shared_by_two_patched_models():
    """Two patched models with one lm_head module (each forward installs its own wrapper on it) train as unpatched,
    in turn; unpatching one leaves the other patched."""
    first, second = make_model(), make_model(seed=5)
    second.lm_head = first.lm_head
    refs = [twin(first), twin(second)]
    refs[1].lm_head = refs[0].lm_head
    fused_lm_loss.patch(first)
    fused_lm_loss.patch(second)
    batch = make_batch()
    for m, ref in ((first, refs[0]), (second, refs[1]), (first, refs[0])):
        _trains_as_unpatched(m, ref, batch)
    fused_lm_loss.unpatch(first)
    _trains_as_unpatched(second, refs[1], batch)


def test_loss_type_changed_after_patch_raises():
    """The default loss stands in for transformers' ForCausalLMLoss: a loss_type set after patch() that picks another
    loss raises at the next training forward (another causal-LM type trains on); eval computes the model's own."""
    model = make_model()
    ref = twin(model)
    fused_lm_loss.patch(model)
    batch = make_batch()
    model.loss_type = ref.loss_type = "ForCausalLM"
    _trains_as_unpatched(model, ref, batch)
    model.loss_type = ref.loss_type = "ForMaskedLM"
    with pytest.raises(RuntimeError, match="loss_type is now 'ForMaskedLM'"):
        model(**batch)
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, ref(**batch).loss)


def test_loss_assigned_through_fsdp1_and_deepspeed_takes_effect():
    """``wrapper.loss_function = FusedLMLoss(...)`` on FSDP1's FullyShardedDataParallel or DeepSpeed's engine patches
    the model inside (one gloo rank, in a subprocess: the process group stays out of this one)."""
    import subprocess
    import sys

    code = (
        "import os, torch, torch.distributed as dist, fused_lm_loss\n"
        "from fused_lm_loss.integrations import is_patched\n"
        "from tests.integrations.hf_models import make_batch, make_model, twin\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1], RANK='0', WORLD_SIZE='1', LOCAL_RANK='0')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel\n"
        "wrappers = {'fsdp1': lambda m: FullyShardedDataParallel(m, device_id=torch.device('cpu'), use_orig_params=True)}\n"
        "try:\n"
        "    import deepspeed\n"
        "    config = {'train_micro_batch_size_per_gpu': 1, 'zero_optimization': {'stage': 0},\n"
        "              'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}}\n"
        "    wrappers['deepspeed'] = lambda m: deepspeed.initialize(model=m, model_parameters=m.parameters(),\n"
        "                                                           config=config)[0]\n"
        "except ImportError:\n"
        "    pass\n"
        "batch = make_batch()\n"
        "for name, wrap in wrappers.items():\n"
        "    model = make_model()\n"
        "    ref = twin(model)\n"
        "    ref.loss_function = fused_lm_loss.FusedLMLoss(label_smoothing=0.5)\n"
        "    wrapped = wrap(model)\n"
        "    wrapped.loss_function = fused_lm_loss.FusedLMLoss(label_smoothing=0.5)\n"
        "    got, want = wrapped(**batch).loss.item(), ref(**batch).loss.item()\n"
        "    print(name, is_patched(model), abs(got - want) <= 1e-5 * abs(want))\n"
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    run = subprocess.run([sys.executable, "-c", "import sys\n" + code, port], capture_output=True, env=env,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    lines = [line.split() for line in run.stdout.decode().splitlines() if line.split()[:1] in (["fsdp1"], ["deepspeed"])]
    assert lines and all(line[1:] == ["True", "True"] for line in lines), run.stdout.decode() + run.stderr.decode()[-3000:]


def test_importing_has_no_global_side_effect():
    """Importing fused_lm_loss registers no global nn.Module hook; the first FusedLMLoss installs the one that
    makes ``model.loss_function = FusedLMLoss(...)`` take effect (in a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import torch.nn.modules.module as m\n"
        "import fused_lm_loss\n"
        "before = len(m._global_module_registration_hooks)\n"
        "fused_lm_loss.FusedLMLoss()\n"
        "print(before, len(m._global_module_registration_hooks))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "1"]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_temperature_on_a_patched_model(family):
    """FusedLMLoss(temperature=T) on a patched model (with the model's own softcap, for Gemma 2): the training
    loss and gradients and the eval loss (from the model's logits) equal cross-entropy of logits / T computed
    here, in float64 from the unpatched model's logits."""
    temperature, smoothing = 0.7, 0.1
    model = make_model(family)
    ref = twin(model)
    fused_lm_loss.patch(model, FusedLMLoss(temperature=temperature, label_smoothing=smoothing))
    batch = make_batch()
    out, got = _train_step(model, **batch)

    def reference(logits):
        targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.double().flatten(0, 1) / temperature, targets.flatten(),
                               label_smoothing=smoothing)

    ref.zero_grad(set_to_none=True)
    want_loss = reference(ref(input_ids=batch["input_ids"]).logits)
    want_loss.backward()
    assert rel_err(out.loss.detach(), want_loss.detach()) <= 2e-5
    assert_close_grads(got, grads(ref))
    model.eval()
    with torch.no_grad():
        eval_loss = model(**batch).loss
        assert rel_err(eval_loss, reference(ref.eval()(input_ids=batch["input_ids"]).logits)) <= 2e-5


@pytest.mark.parametrize("options", [dict(return_z_loss=True), dict(return_token_accuracy=True),
                                     dict(class_weight=torch.ones(VOCAB))], ids=lambda o: next(iter(o)))
def test_patch_refuses_what_a_model_loss_cannot_return(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        fused_lm_loss.patch(make_model(), FusedLMLoss(**options))


def test_patch_and_fsdp2_in_either_order(tmp_path):
    """FSDP2's fully_shard subclasses the model's class (accelerate shards the root model, after a patch() made
    before Trainer): attribute assignment (model.train()) recursed, and a sharded peft model was not recognised,
    so patch() refused it and a loss_function assignment was silently ignored. Each order now runs the fused loss
    with the unpatched model's loss; unpatch() refuses to drop FSDP2's class; a backward that must recompute with
    a weight FSDP2 freed after forward says so. One gloo rank."""
    from .. import _dist_workers as workers

    out = workers.spawn(workers.patched_fsdp2_worker, 1, tmp_path)[0]
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["unpatched"]["fused"] == 0
    for name in ("patch_then_shard", "shard_then_patch"):
        assert out[name]["fused"] == 1, name
        assert rel_err(out[name]["loss"], out["unpatched"]["loss"]) <= 1e-6, name
    assert "fully_shard" in out["unpatch_error"]
    # a backward that recomputes with a weight FSDP2 freed after forward: said, naming the fix
    assert "reshard_after_forward=False" in out["freed_weight_error"]
    if "lora_patched" in out:
        assert out["lora_unpatched"]["fused"] == 0
        for name in ("lora_patched", "lora_assigned"):
            assert out[name]["fused"] == 1, name
            assert rel_err(out[name]["loss"], out["lora_unpatched"]["loss"]) <= 1e-6, name
