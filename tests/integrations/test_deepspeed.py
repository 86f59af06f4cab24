"""DeepSpeed on CPU (gloo, two ranks; on a GPU run, one rank over NCCL): a patched model whose lm_head is ZeRO-3
partitioned trains as the unpartitioned model does: every step's loss, every gradient after DeepSpeed's reduction
and the parameters after the optimizer steps, for untied and tied embeddings, LoRA on the attention and on lm_head,
ZeRO-2 and ZeRO-3 offloading to CPU; TRL's fused-head calls on a partitioned head run our kernels; and
``Trainer(deepspeed=...)`` and TRL's trainers train patched as unpatched."""
import os
import warnings

import pytest

from .. import _dist_workers as workers
from .hf_models import assert_same_training, rel_err

pytest.importorskip("deepspeed")

ON_CUDA = os.environ.get("FUSED_LM_LOSS_TEST_DEVICE", "cpu") == "cuda"


def _spawn(worker, tmp_path, cases):
    """The worker's results; once again if a rank died of a signal (not an exception: a failed check in a worker
    raises). DeepSpeed on CPU aborted a rank once in ~12 runs of this file on the 2-core CI machine
    (SIGABRT, no Python traceback)."""
    import torch.multiprocessing as mp

    for attempt in range(2):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        try:
            if ON_CUDA:
                return workers.spawn(worker, 1, folder, cases, "cuda", backend="nccl")
            return workers.spawn(worker, 2, folder, cases)
        except mp.ProcessExitedException as error:
            if attempt == 1 or error.signal_name is None:
                raise
            warnings.warn(f"a DeepSpeed rank died of {error.signal_name}; running the workers again")


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return _spawn(workers.zero3_worker, tmp_path_factory.mktemp("zero3"), workers.ZERO3_CASES)


@pytest.mark.parametrize("case", workers.ZERO3_CASES)
def test_deepspeed_patched_model_trains_as_unpartitioned(zero3, case):
    for rank in zero3:
        out = rank[case]
        assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-5)
        for got, want in zip(out["grads"], out["ref_grads"]):
            assert got.keys() == want.keys() and got
            for name in want:
                assert rel_err(got[name], want[name]) <= 1e-5, (case, name)
        if case == "lora":  # the trainable lm_head: LoRA's B reaches the fused loss as a weight of its own
            assert any("lm_head" in name for name in out["grads"][0])
        for name, value in out["ref_params"].items():
            assert rel_err(out["params"][name], value) <= 1e-5, (case, name)
        if case == "zero2":
            continue
        for reduction in ("mean", "none"):
            for released, whole in zip(*out[f"teacher_released_grads_{reduction}"]):
                assert rel_err(released, whole) == 0.0, reduction
        for name in ("partition_error", "divergence_partition_error"):
            assert "ZeRO-3 partition, not gathered" in out.get(name, "no error"), name
        if case != "lora":
            for name in ("backward_error", "divergence_backward_error"):
                assert "ZeRO-3 partition again" in out.get(name, "no error"), name


@pytest.fixture(scope="module")
def zero3_trl(tmp_path_factory):
    pytest.importorskip("trl")
    return _spawn(workers.zero3_trl_worker, tmp_path_factory.mktemp("zero3_trl"), workers.ZERO3_TRL_CASES)


@pytest.mark.parametrize("case", workers.ZERO3_TRL_CASES)
def test_zero3_head_in_trl_runs_our_kernels_as_trl_does_unpartitioned(zero3_trl, case):
    """TRL's fused head (per-sequence weights: backward recomputes with the gathered head) and the distillation
    loss, on a ZeRO-3 partitioned student head: our kernels serve every call, and the losses, DeepSpeed's reduced
    gradients and the trained parameters equal TRL's own functions on the unpartitioned model."""
    for rank in zero3_trl:
        out = rank[case]
        assert out["served"] == len(out["loss"])
        assert out["loss"] == pytest.approx(out["ref_loss"], rel=1e-5)
        for got, want in zip(out["grads"], out["ref_grads"]):
            assert got.keys() == want.keys() and "lm_head.weight" in got
            for name in want:
                assert rel_err(got[name], want[name]) <= 1e-5, (case, name)
        for name, value in out["ref_params"].items():
            assert rel_err(out["params"][name], value) <= 1e-5, (case, name)


@pytest.fixture(scope="module")
def zero3_trainers(tmp_path_factory):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    return _spawn(workers.zero3_trainer_worker, tmp_path_factory.mktemp("zero3_trainers"), workers.ZERO3_TRAINER_CASES)


@pytest.mark.parametrize("case", workers.ZERO3_TRAINER_CASES)
def test_trainers_with_a_zero3_config_train_patched_as_unpatched(zero3_trainers, case):
    """``Trainer(deepspeed=...)`` and TRL's SFT (full and LoRA), DPO, GRPO and distillation trainers, ZeRO-3
    (every parameter partitioned): the patched run logs the unpatched run's numbers and ends with its parameters,
    and our kernels served its loss calls (the patched forward, or TRL's fused head / divergence)."""
    for rank in zero3_trainers:
        got, want = rank[(case, "patched")], rank[(case, "unpatched")]
        assert got["engine"] == want["engine"] == "DeepSpeedEngine"
        assert got["served"] >= 2 and want["served"] == 0
        assert len(want["logs"]) >= 2
        assert_same_training(got["logs"], got["params"], want["logs"], want["params"])
