"""transformers' Trainer: per-step losses and final parameters match an unpatched run (TRL: test_trl.py)."""
from __future__ import annotations

import pytest
import torch

import fused_lm_loss

from ..conftest import TEST_DEVICE
from .hf_models import VOCAB, make_model, rel_err

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _dataset(n=16, seq=10, seed=0):
    g = torch.Generator("cpu").manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (seq,), generator=g, device="cpu")
        labels = ids.clone()
        labels[: int(torch.randint(0, seq - 2, (1,), generator=g, device="cpu"))] = -100  # ragged prompts: num_items matters
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _train(tmp_path, patched, grad_accum, **args):
    model = make_model()
    if patched:
        fused_lm_loss.patch(model)
    config = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"run_{patched}_{grad_accum}"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=grad_accum,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=TEST_DEVICE == "cpu",
        seed=0,
        tf32=False,  # torch_compile=True would turn TF32 on (CUDA): the comparison is of fp32 runs
        **args,
    )
    trainer = transformers.Trainer(model=model, args=config, train_dataset=_dataset())
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("grad_accum", [2, 4])
def test_trainer_gradient_accumulation_parity(tmp_path, grad_accum):
    losses, params = _train(tmp_path, True, grad_accum)
    want_losses, want_params = _train(tmp_path, False, grad_accum)
    assert len(losses) == 3
    assert losses == pytest.approx(want_losses, rel=2e-4)
    for name, value in want_params.items():
        assert rel_err(params[name], value) <= 2e-4, name


def test_trainer_torch_compile_trains_like_eager(tmp_path, monkeypatch):
    """Trainer(torch_compile=True) on a patched model: our chunk loop runs at every step, with the same
    per-step losses and parameters as an eager unpatched run."""
    import fused_lm_loss.ops

    calls = []
    original = fused_lm_loss.ops.run_chunks
    monkeypatch.setattr(fused_lm_loss.ops, "run_chunks", lambda *a, **k: calls.append(1) or original(*a, **k))
    torch._dynamo.reset()
    losses, params = _train(tmp_path, True, 2, torch_compile=True)
    assert len(calls) == 3 * 2  # 3 steps of 2 micro-batches
    want_losses, want_params = _train(tmp_path, False, 2)
    assert losses == pytest.approx(want_losses, rel=1e-4)
    for name, value in want_params.items():
        assert rel_err(params[name], value) <= 1e-4, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 GradScaler training needs CUDA")
def test_trainer_fp16_grad_scaler(tmp_path):
    def run(patched):
        model = make_model().cuda()
        config = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"fp16_{patched}"), per_device_train_batch_size=2, max_steps=3,
            logging_steps=1, report_to=[], save_strategy="no", fp16=True, seed=0,
        )
        trainer = transformers.Trainer(model=model, args=config, train_dataset=_dataset())
        if patched:  # the documented wiring: the scaler reaches the fused loss
            fused_lm_loss.patch(model, grad_scaler=trainer.accelerator.scaler)
        trainer.train()
        return [log["loss"] for log in trainer.state.log_history if "loss" in log]

    assert run(True) == pytest.approx(run(False), rel=1e-2)
