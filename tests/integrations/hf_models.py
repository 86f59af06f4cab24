"""Tiny random-config causal LMs of every supported family, and the patched-vs-unpatched comparison."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _family_configs():
    """family -> (config class, model class, config overrides); class names, as old transformers lack some."""
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
        "gemma2": (
            "Gemma2Config",
            "Gemma2ForCausalLM",
            {"head_dim": 8, "final_logit_softcapping": 2.0, "query_pre_attn_scalar": 8, "sliding_window": 8},
        ),
        "gemma3": (
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            {"head_dim": 8, "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 8, "sliding_window": 8},
        ),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
        "mixtral": (
            "MixtralConfig",
            "MixtralForCausalLM",
            {
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "output_router_logits": True,
                "router_aux_loss_coef": 0.1,
            },
        ),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            {
                "head_dim": 8,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "output_router_logits": True,
                "router_aux_loss_coef": 0.1,
            },
        ),
        "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
        "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
    }


FAMILIES = list(_family_configs())


def make_model(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    config_name, model_name, extra = _family_configs()[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    return model_cls(config).float().train()


def make_batch(batch: int = 2, seq: int = 12, seed: int = 1) -> dict:
    g = torch.Generator("cpu").manual_seed(seed)  # the same batch on every device
    input_ids = torch.randint(0, VOCAB, (batch, seq), generator=g, device="cpu").to(torch.get_default_device())
    labels = input_ids.clone()
    labels[0, :3] = -100  # prompt tokens carry no loss
    labels[-1, -2:] = -100  # padding
    return {"input_ids": input_ids, "labels": labels}


def grads(model: torch.nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_close_grads(got: dict, want: dict, tol: float = 2e-4) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert rel_err(got[name], want[name]) <= tol, name


def assert_same_training(got_logs: list, got_params: dict, want_logs: list, want_params: dict,
                         tol: float = 1e-5) -> None:
    """Two training runs agree: every logged float but timings (rel ``tol``, abs 1e-6), the same keys in every
    log, and every final parameter (rel ``tol``)."""
    assert len(got_logs) == len(want_logs)
    for g, w in zip(got_logs, want_logs):
        assert g.keys() == w.keys()
        # KTO's KL is a difference of summed log-probabilities (policy - reference): its round-off is that of
        # the sums (the logged logps/*), not of the small difference (on CUDA the two heads' matmuls round apart)
        logps = [abs(v) for k, v in w.items() if "logps/" in k and isinstance(v, float)]
        for key, value in w.items():
            timing = any(word in key for word in ("runtime", "per_second", "step_time"))
            if isinstance(value, float) and not timing:
                slack = tol * max(logps) if key.endswith("kl") and logps else 1e-6
                assert g[key] == pytest.approx(value, rel=tol, abs=slack), key
    assert got_params.keys() == want_params.keys()
    for name, value in want_params.items():
        assert rel_err(got_params[name], value) <= tol, name


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An identical unpatched copy to compare against."""
    return copy.deepcopy(model)
