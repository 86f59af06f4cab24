"""Vocab parallelism, DDP and FSDP2 on CPU: gloo ranks spawned by torch.multiprocessing.

Each module fixture spawns the ranks once and runs many cases there (process start-up dominates);
the tests below compare the saved results with float64 references computed here, independently of
the library (full logits, autograd).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from . import _dist_workers as workers
from ._dist_workers import IGNORE, Case

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

FP32_TOL, BF16_TOL = 2e-4, 3e-2


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to max |expected| (absolute when expected is all zero)."""
    scale = expected.abs().max().item() or 1.0
    return (actual.double() - expected.double()).abs().max().item() / scale


def reference(case: Case, data: dict) -> dict:
    """float64 loss and gradients of the unsharded problem, from the full logits."""
    names = ("hidden", "weight", "bias", "low_rank_input", "low_rank_weight")
    leaves = {k: data[k].clone().requires_grad_() for k in names if data.get(k) is not None}
    opts = case.options
    logits = leaves["hidden"] @ leaves["weight"].T
    if "bias" in leaves:
        logits = logits + leaves["bias"]
    if "low_rank_input" in leaves:
        logits = logits + leaves["low_rank_input"] @ leaves["low_rank_weight"].T
    z = logits * opts.get("logit_scale", 1.0)
    if opts.get("softcap") is not None:
        z = opts["softcap"] * torch.tanh(z / opts["softcap"])
    labels = data["labels"]
    valid = labels != IGNORE
    lse = torch.logsumexp(z, dim=-1)
    target = z.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    eps = opts.get("label_smoothing", 0.0)
    per_token = (1 - eps) * (lse - target) + eps * (lse - z.mean(dim=-1)) + opts.get("z_loss", 0.0) * lse**2
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    if case.reduction == "none":
        loss = per_token
        loss.backward(data["grad_output"])
    else:
        loss = per_token.sum()
        if case.reduction == "mean":
            loss = loss / max(case.num_items or int(valid.sum()), 1)
        scale = 512.0 if case.grad_scaler else case.scaling or 1.0
        (loss * scale).backward()
    return {"loss": loss.detach(), **{k: t.grad for k, t in leaves.items()}}


def check_case(case: Case, per_rank: list[dict]) -> None:
    world = len(per_rank)
    data = workers.make_data(case, world)
    expected = reference(case, data)
    tol = FP32_TOL if case.dtype == torch.float32 else BF16_TOL
    bounds = workers.shard_bounds(case, world)

    for rank, out in enumerate(per_rank):
        assert out["loss"].dtype == torch.float32
        assert rel_error(out["loss"], expected["loss"]) <= tol, f"rank {rank}: loss {out['loss']} vs {expected['loss']}"
        assert out["hidden"].dtype == case.dtype
    # dW, db, dB: each rank holds exactly its rows of the full gradient.
    for name in ("weight", "bias", "low_rank_weight"):
        if name not in expected:
            continue
        for rank, (start, size) in enumerate(bounds):
            grad = per_rank[rank][name]
            assert grad.shape[0] == size and grad.dtype == case.dtype
            error = rel_error(grad, expected[name][start : start + size])
            assert error <= tol, f"rank {rank}: grad {name} shard rel. error {error:.2e}"
    # dX, du: summed over the group on every rank, or partial (summed here) with reduce_grad_input=False.
    for name in ("hidden", "low_rank_input"):
        if name not in expected:
            continue
        if case.options.get("reduce_grad_input", True):
            for rank, out in enumerate(per_rank):
                error = rel_error(out[name], expected[name])
                assert error <= tol, f"rank {rank}: grad {name} rel. error {error:.2e}"
        else:
            partials = [out[name] for out in per_rank]
            assert all(rel_error(p, expected[name]) > tol for p in partials), "a partial dX should not be the full one"
            error = rel_error(sum(p.double() for p in partials), expected[name])
            assert error <= tol, f"summed partial grad {name} rel. error {error:.2e}"
    if case.labels == "all_ignored":
        for out in per_rank:
            assert not out["loss"].any() and not out["hidden"].any() and not out["weight"].any()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("vp2")
    return workers.spawn(workers.vocab_parallel_worker, 2, tmp, workers.CASES_2, True, [0, 1])


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("vp3")
    return workers.spawn(workers.vocab_parallel_worker, 3, tmp, workers.CASES_3, False, [1, 2])


@pytest.mark.parametrize("case", workers.CASES_2, ids=lambda c: c.name)
def test_vocab_parallel_two_ranks(two_ranks, case):
    check_case(case, [out[case.name] for out in two_ranks])


@pytest.mark.parametrize("case", workers.CASES_3, ids=lambda c: c.name)
def test_vocab_parallel_three_ranks(three_ranks, case):
    check_case(case, [out[case.name] for out in three_ranks])


def test_vocab_parallel_over_a_subgroup(three_ranks):
    """Ranks 1 and 2 of 3 form the group: global rank 1 is group rank 0 and holds the first shard."""
    check_case(workers.SUBGROUP_CASE, [three_ranks[rank][workers.SUBGROUP_CASE.name] for rank in (1, 2)])
    assert workers.SUBGROUP_CASE.name not in three_ranks[0]


def test_bf16_grad_input_rounds_like_one_device(two_ranks):
    """The fp32 all-reduce of partial dX: bf16 dX within one rounding of the unsharded bf16 run."""
    for name in ("bf16", "bf16_fp32_logits"):
        for out in two_ranks:
            sharded, single = out[name]["hidden"].float(), out[name]["single_hidden"].float()
            ulp = torch.finfo(torch.bfloat16).eps * single.abs()
            assert ((sharded - single).abs() <= ulp + 1e-6).all(), name


def test_mistakes_raise_the_same_error_on_every_rank(two_ranks):
    errors = [out["errors"] for out in two_ranks]
    for compiled in (errors[0].pop("compiled"), errors[1].pop("compiled")):
        assert compiled != "no error"
        if _torch_version() >= (2, 6):  # (torch 2.5's Dynamo reports "Observed exception" without its message)
            assert "process_group) does not run under torch.compile" in compiled, compiled
    assert errors[0] == errors[1]  # same message everywhere: no rank left waiting in a collective
    expected = {
        "label_out_of_range": "outside [0, 40)",
        "size_mismatch": "disagree on the vocabulary size",
        "overlap": "without gaps or overlaps",
        "gap": "without gaps or overlaps",
        "labels_not_replicated": "same labels",
        "labels_differ_same_counts": "same labels",
        "label_changes_that_cancel": "same labels",
        "no_tokens_on_one_rank": "same labels",
        "num_items_differs": "same num_items_in_batch",
        "num_items_invalid_on_one_rank": "same num_items_in_batch",
        "label_out_of_range_on_one_rank": "same labels",
        "options_differ": "same loss options",
        "chunk_size_differs": "same loss options",
        "grad_on_one_rank": "same inputs requiring grad",
        "dtensor_weight": "weight is a DTensor",
    }
    for key, fragment in expected.items():
        assert fragment in errors[0][key], (key, errors[0][key])
    assert errors[0]["signed_zero_z_loss"] == "no error"
    assert errors[0]["then_ok"] > 0


def test_example_reports_ok(two_ranks):
    """examples/vocab_parallel.py's check (what ``torchrun --nproc_per_node 2`` runs), on the spawned ranks."""
    for out in two_ranks:
        assert out["example"]["ok"], out["example"]
    assert two_ranks[0]["example"]["shard_rows"] == (0, 2050) and two_ranks[1]["example"]["shard_rows"] == (2050, 2049)


# ----------------------------------------------------------------------------------------------
# DDP and FSDP2


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory) -> list[dict]:
    return workers.spawn(workers.data_parallel_worker, 2, tmp_path_factory.mktemp("dp"))


def _compare_step(per_rank: list[dict], expected: dict) -> None:
    for rank, out in enumerate(per_rank):
        for kind in ("grads", "params"):
            assert out[kind].keys() == expected[kind].keys()
            for name, value in out[kind].items():
                error = rel_error(value, expected[kind][name])
                assert error <= FP32_TOL, f"rank {rank}: {kind} {name} rel. error {error:.2e}"


@pytest.mark.parametrize("scenario", workers.DP_SCENARIOS, ids=lambda s: s.name)
def test_ddp_step_matches_single_process(data_parallel, scenario):
    _compare_step([out["ddp"][scenario.name] for out in data_parallel], workers.reference_step(scenario, 2))


#: FSDP2 on CPU/gloo is verified from this torch on; an older one may lack CPU support (then: skip).
FSDP2_CPU_VERIFIED = (2, 13)


def _fsdp_results(data_parallel: list[dict]) -> list[dict]:
    for out in data_parallel:
        if isinstance(out["fsdp"], str):
            if _torch_version() >= FSDP2_CPU_VERIFIED:
                pytest.fail(f"FSDP2 step failed:\n{out['fsdp']}")
            pytest.skip(f"FSDP2 does not run on CPU/gloo with torch {torch.__version__}:\n{out['fsdp']}")
    return [out["fsdp"] for out in data_parallel]


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("scenario", workers.DP_SCENARIOS, ids=lambda s: s.name)
def test_fsdp2_step_matches_single_process(data_parallel, scenario):
    per_rank = [out[scenario.name] for out in _fsdp_results(data_parallel)]
    assert all(out["sharded"] for out in per_rank)
    _compare_step(per_rank, workers.reference_step(scenario, 2))


def test_fsdp2_sharded_weight_is_refused(data_parallel):
    for out in _fsdp_results(data_parallel):
        for scenario in workers.DP_SCENARIOS:
            message = out[scenario.name]["dtensor_error"]
            assert "weight is a DTensor" in message and "inside the lm_head module's forward" in message, message
