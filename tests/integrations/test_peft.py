"""patch() on peft models: LoRA on attention only, LoRA on lm_head (fused as a low-rank term), modules_to_save."""
from __future__ import annotations

import pytest
import torch

import fused_lm_loss
from fused_lm_loss import FusedLMLoss

peft = pytest.importorskip("peft")
from .hf_models import assert_close_grads, grads, make_batch, make_model, rel_err, twin  # noqa: E402


def _peft(model, seed=0, **config):
    torch.manual_seed(seed)
    config = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], **config}
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**config))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; make the adapter contribute
            torch.nn.init.normal_(p, std=0.1)
    return peft_model


def _pair(family="llama", **config):
    base = make_model(family)
    ref = _peft(twin(base), **config)
    fused = _peft(base, **config)
    fused_lm_loss.patch(fused)
    return fused, ref


def _step(model, seed=5, **batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in both models
    out = model(**batch)
    out.loss.backward()
    return out, grads(model)


def _compare(fused, ref, **kwargs):
    batch = {**make_batch(), **kwargs}
    out, got = _step(fused, **batch)
    want_out, want = _step(ref, **batch)
    assert out.logits is None
    assert rel_err(out.loss.detach(), want_out.loss.detach()) <= 2e-4
    assert_close_grads(got, want)
    return got


def test_lora_attention_only_leaves_lm_head_frozen():
    fused, ref = _pair()
    got = _compare(fused, ref)
    assert not any("lm_head" in name for name in got)
    assert fused.get_base_model().lm_head.weight.grad is None


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_lora_on_lm_head_is_fused_with_dropout(family):
    fused, ref = _pair(family, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.1)
    assert type(fused.get_base_model().lm_head).__name__ == "Linear"  # peft's lora.Linear
    got = _compare(fused, ref)
    assert any("lm_head.lora_A" in n for n in got) and any("lm_head.lora_B" in n for n in got)


def test_lora_on_tied_lm_head():
    fused, ref = _pair("llama_tied", target_modules=["lm_head"])
    _compare(fused, ref)


def test_two_active_adapters_on_lm_head():
    fused, ref = _pair(target_modules=["lm_head"])
    for model in (fused, ref):
        torch.manual_seed(3)
        model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=2, target_modules=["lm_head"]))
        torch.nn.init.normal_(model.get_base_model().lm_head.lora_B["second"].weight, std=0.1)
        model.base_model.set_adapter(["default", "second"])
    got = _compare(fused, ref)
    assert any("lora_B.second" in n for n in got)


def test_disabled_adapter_uses_base_only():
    fused, ref = _pair(target_modules=["lm_head"])
    batch = make_batch()
    with fused.disable_adapter(), ref.disable_adapter():  # nothing trainable is left: compare the loss
        got, want = fused(**batch), ref(**batch)
    assert got.logits is None
    assert rel_err(got.loss, want.loss) <= 2e-4
    assert rel_err(fused(**batch).loss.detach(), want.loss) > 1e-3  # the adapter is back and matters


def test_modules_to_save_lm_head_trains_the_copy():
    fused, ref = _pair(modules_to_save=["lm_head"])
    got = _compare(fused, ref)
    assert any("lm_head.modules_to_save" in n for n in got)
    assert not any("lm_head.original_module" in n for n in got)


def test_loss_function_assignment_through_peft_model():
    fused, ref = _pair(target_modules=["lm_head"])
    fused.loss_function = FusedLMLoss(z_loss=1e-2)
    assert fused.get_base_model().loss_function.options.z_loss == 1e-2
    assert fused(**make_batch()).logits is None


def test_dora_on_lm_head_is_rejected():
    model = _peft(make_model(), target_modules=["lm_head"], use_dora=True)
    with pytest.raises(NotImplementedError, match="DoRA"):
        fused_lm_loss.patch(model)


def test_lora_head_as_its_own_fsdp2_unit_is_refused_clearly():
    """FSDP2's fully_shard swaps lm_head's class for FSDPLinear(FSDPModule, lora.Linear): the head is recognized
    as LoRA through it, and refused with a clear error, since FSDP2 would gather the adapters for backward only
    through a hook on lm_head's output, which the fused loss never uses. (The swap is made here as fully_shard
    makes it, without a process group.)"""
    from fused_lm_loss.integrations.peft import FSDP2_MODULE, _own_class

    if FSDP2_MODULE is None:
        pytest.skip("no FSDP2 in this torch")
    model = _peft(make_model(), target_modules=["lm_head"])
    head = model.get_base_model().lm_head
    lora_class = type(head)
    head.__class__ = type(f"FSDP{lora_class.__name__}", (FSDP2_MODULE, lora_class), {})
    assert _own_class(head) is lora_class
    with pytest.raises(NotImplementedError, match="FSDP2 shards as a unit of its own"):
        fused_lm_loss.patch(model)


def test_unpatch_peft_model():
    fused, _ = _pair(target_modules=["lm_head"])
    fused_lm_loss.unpatch(fused)
    assert fused(**make_batch()).logits is not None


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_base_with_fp32_adapters(autocast):
    """peft keeps adapters in fp32 next to a bf16 base (or runs under autocast): bf16-level agreement."""
    base = make_model("gemma2")
    if not autocast:
        base = base.bfloat16()
    config = dict(target_modules=["q_proj", "lm_head"])
    ref, fused = _peft(twin(base), **config), _peft(base, **config)
    fused_lm_loss.patch(fused)
    assert all(p.dtype == torch.float32 for n, p in fused.named_parameters() if "lora_" in n)
    results = []
    for model in (fused, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, got = _step(model, **make_batch())
        results.append((out.loss.detach().float(), got))
    (loss, got), (want_loss, want) = results
    assert rel_err(loss, want_loss) <= 1e-3
    assert_close_grads(got, want, tol=3e-2)


def test_loss_function_assignment_on_unpatched_peft_model_patches_the_base():
    model = _peft(make_model(), target_modules=["lm_head"])
    model.loss_function = FusedLMLoss()
    assert fused_lm_loss.integrations.is_patched(model)
    assert model(**make_batch()).logits is None
    fused_lm_loss.unpatch(model)
    assert "loss_function" not in model._modules and model(**make_batch()).logits is not None
