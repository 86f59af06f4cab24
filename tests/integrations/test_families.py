"""patch() on the model families whose forward transforms its logits in its own way (hf_config's tables):
each matches the unpatched model, or is refused with an error, never trained with a wrong loss."""
from __future__ import annotations

import pytest
import torch

import fused_lm_loss

from .hf_models import VOCAB, assert_close_grads, grads, rel_err, twin

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
MAMBA = dict(mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4,
             mamba_n_heads=8, mamba_d_head=8)
TEXT = dict(SMALL, num_key_value_heads=2, head_dim=8)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, image_size=16,
              patch_size=4, model_type="siglip_vision_model")

# family -> (model class, config class, config kwargs, what the forward does to the logits)
FAMILIES = {
    "falcon_h1_lm_head_multiplier": (
        "FalconH1ForCausalLM", "FalconH1Config",
        dict(SMALL, num_key_value_heads=2, **MAMBA, mamba_d_ssm=64, projectors_bias=False, mamba_use_mlp=True,
             lm_head_multiplier=0.5),
    ),
    "recurrent_gemma_soft_cap": (
        "RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
        dict(SMALL, num_key_value_heads=1, head_dim=8, lru_width=32, block_types=["recurrent", "attention"],
             attention_window_size=8, logits_soft_cap=5.0),
    ),
    "minicpm3_scales_hidden_states": (
        "MiniCPM3ForCausalLM", "MiniCPM3Config",
        dict(SMALL, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
             v_head_dim=8, dim_model_base=8),  # logits_scaling = hidden_size / dim_model_base = 4
    ),
    "xlstm_soft_cap": (
        "xLSTMForCausalLM", "xLSTMConfig",
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, chunk_size=4, embedding_dim=32,
             num_blocks=2, ffn_round_up_to_multiple_of=16, output_logit_soft_cap=5.0),
    ),
    "bamba_without_z_loss": (
        "BambaForCausalLM", "BambaConfig",
        dict(SMALL, num_key_value_heads=2, **MAMBA, attn_layer_indices=[1], use_mamba_kernels=False,
             z_loss_coefficient=0.0),
    ),
    "hyperclovax_multiplies_by_logits_scaling": (  # (Granite divides by its field of that name)
        "HyperCLOVAXForCausalLM", "HyperCLOVAXConfig", dict(TEXT, logits_scaling=0.5),
    ),
    "paligemma2_text_softcap": (
        "PaliGemmaForConditionalGeneration", "PaliGemmaConfig",
        dict(text_config=dict(TEXT, model_type="gemma2", query_pre_attn_scalar=8, sliding_window=8,
                              final_logit_softcapping=3.0),
             vision_config=VISION, image_token_index=VOCAB - 1, projection_dim=32),
    ),
    "gemma3_multimodal_ignores_text_softcap": (
        "Gemma3ForConditionalGeneration", "Gemma3Config",
        dict(text_config=dict(TEXT, query_pre_attn_scalar=8, sliding_window=8, final_logit_softcapping=3.0),
             vision_config=VISION, mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2,
             eoi_token_index=VOCAB - 3),
    ),
}


def _build(family: str, **overrides) -> torch.nn.Module:
    model_name, config_name, kwargs = FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(**{**kwargs, **overrides})
    config._attn_implementation = "eager"
    config.get_text_config()._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).float().train()


def _batch(model) -> dict:
    g = torch.Generator("cpu").manual_seed(1)
    ids = torch.randint(4, VOCAB - 8, (2, 12), generator=g, device="cpu").to(torch.get_default_device())  # clear of the image / special tokens
    labels = ids.clone()
    labels[0, :3] = -100
    labels[-1, -2:] = -100
    batch = {"input_ids": ids, "labels": labels}
    if "PaliGemma" in type(model).__name__ or "Gemma3For" in type(model).__name__:
        batch["token_type_ids"] = torch.ones_like(ids)  # all text
    if "xLSTM" in type(model).__name__:
        batch["use_cache"] = False
    return batch


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, grads(model)


def _ignores_its_text_softcap(model) -> bool:
    """Older transformers (5.17) build PaliGemma's logits without the text config's final_logit_softcapping
    (5.24 applies it)."""
    import inspect

    return "final_logit_softcapping" not in inspect.getsource(type(model).forward)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_unpatched(family):
    model = _build(family)
    ref = twin(model)
    fused_lm_loss.patch(model)
    batch = _batch(model)
    if family == "paligemma2_text_softcap" and _ignores_its_text_softcap(model):
        # the config says softcap 3, the forward applies none: the probe check refuses, never trains wrong
        with pytest.raises(RuntimeError, match="does not reproduce"):
            _step(model, batch)
        return
    out, got = _step(model, batch)
    want_out, want = _step(ref, batch)
    assert out.logits is None
    assert rel_err(out.loss.detach(), want_out.loss.detach()) <= 2e-4
    assert_close_grads(got, want, tol=2e-4 if "xlstm" not in family else 1e-3)


def test_bamba_z_loss_is_refused_at_patch_time():
    """Bamba adds a z-loss of its logits after self.loss_function; patched, those logits are the probe."""
    model = _build("bamba_without_z_loss", z_loss_coefficient=0.01)
    with pytest.raises(TypeError, match="z_loss_coefficient"):
        fused_lm_loss.patch(model)


def test_logits_read_after_the_loss_raise_at_the_first_forward():
    """Any forward that computes with its logits after self.loss_function (a z-loss, a penalty) gets an error
    at its first training forward: the logits it would read are the probe, filled with NaN."""
    from .hf_models import make_batch, make_model

    from transformers.modeling_outputs import CausalLMOutputWithPast

    class ZLossLlama(transformers.LlamaForCausalLM):  # what Bamba does with z_loss_coefficient > 0
        def forward(self, input_ids=None, labels=None, **kwargs):
            logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
                loss = loss + 1e-2 * logits.float().logsumexp(-1).pow(2).mean()
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    base = make_model("llama")
    model = ZLossLlama(base.config)
    model.load_state_dict(base.state_dict())
    model.train()
    fused_lm_loss.patch(model)  # nothing in the class tells patch() what its forward does after the loss
    with pytest.raises(RuntimeError, match="after self.loss_function"):
        model(**make_batch())


def test_non_causal_loss_type_is_refused():
    from .hf_models import make_model

    model = make_model("llama")
    model.loss_type = "ForMaskedLM"
    with pytest.raises(TypeError, match="ForCausalLMLoss"):
        fused_lm_loss.patch(model)
