"""Rank processes for tests/test_distributed.py: gloo over a FileStore, spawned by torch.multiprocessing.

Workers compute and ``torch.save`` their results; the test process compares them with float64
references, so a failed comparison is an ordinary pytest failure. Every case's data comes from
``make_data`` (seeded), the same in the workers and in the test process.
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import pathlib
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

IGNORE = -100
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# spawning


def spawn(target: Callable, world: int, tmp_path: pathlib.Path, *args: Any, backend: str = "gloo") -> list[dict]:
    """Run ``target(rank, world, *args)`` on ``world`` ranks (gloo on CPU; "nccl": one GPU per rank); return each
    rank's saved dict."""
    import torch.multiprocessing as mp

    init_file = tmp_path / "store"
    mp.spawn(_entry, args=(world, str(init_file), str(tmp_path), target, args, backend), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _entry(rank: int, world: int, init_file: str, out_dir: str, target: Callable, args: tuple, backend: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        # The Triton interpreter must be chosen before triton is first imported (only the triton case uses it).
        os.environ["TRITON_INTERPRET"] = "1"
    if sys.platform == "linux":  # all ranks are local: loopback works where the hostname does not resolve
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        # a rank out of step fails the test instead of hanging it; generous, since a loaded 2-core machine (one
        # run of the suite beside other work) once took over 60 s for a collective
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        results = target(rank, world, *args)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# vocab-parallel cases


@dataclass(frozen=True)
class Case:
    name: str
    vocab: int = 40
    shards: tuple[int, ...] | None = None  # rows per rank (unequal shards); None: equal shards
    order: tuple[int, ...] | None = None  # which slot of the vocab each rank holds (default: rank order)
    options: dict = field(default_factory=dict)
    bias: bool = False
    rank_lora: int = 0  # low_rank=(u, B) with this rank r
    dtype: torch.dtype = torch.float32
    labels: str = "random"  # "random" | "first_shard" (other ranks hold no label) | "all_ignored"
    num_items: int | None = None
    scaling: float | None = None  # GradScaler semantics: backward of scaling * loss
    grad_scaler: bool = False  # a real torch.amp.GradScaler instead of ``scaling``
    backend: str = "torch"
    functional: bool = False
    seed: int = 0

    @property
    def reduction(self) -> str:
        return self.options.get("reduction", "mean")


FEATURES = dict(label_smoothing=0.1, z_loss=0.01, softcap=5.0, logit_scale=0.8)

CASES_2 = [
    Case("plain"),
    Case("features_mean", options=dict(FEATURES, chunk_size=5), bias=True),
    Case("features_sum_scaling", options=dict(FEATURES, reduction="sum", chunk_size=7), bias=True, scaling=1024.0),
    Case("grad_scaler", options=dict(label_smoothing=0.2), grad_scaler=True, seed=1),
    Case("features_none", options=dict(FEATURES, reduction="none", chunk_size=4), bias=True, seed=2),
    Case("num_items", options=dict(z_loss=0.02, logit_scale=1.3), num_items=25, seed=3),
    Case("unequal", shards=(29, 11), options=dict(label_smoothing=0.1, chunk_size=6), bias=True, seed=4),
    Case("unequal_swapped", shards=(11, 29), order=(1, 0), options=dict(softcap=4.0), seed=5),
    Case("labels_in_first_shard", labels="first_shard", options=dict(label_smoothing=0.1), bias=True, seed=6),
    Case("all_ignored", labels="all_ignored", bias=True),
    Case("all_ignored_none", labels="all_ignored", options=dict(reduction="none")),
    Case("low_rank", rank_lora=4, options=dict(FEATURES, chunk_size=8), bias=True, seed=7),
    Case("partial_grad_input", rank_lora=3, options=dict(reduce_grad_input=False, label_smoothing=0.1), seed=8),
    Case("functional", functional=True, options=dict(z_loss=0.01, reduction="sum"), seed=9),
    Case("triton", backend="triton", options=dict(FEATURES, chunk_size=5), bias=True, seed=10),
    Case("triton_none", backend="triton", options=dict(FEATURES, reduction="none"), seed=11),
    # fp16 Triton forward without gradients (reduction="none"): the statistics merged across ranks (from the logits
    # chunk: with a process group the plan never takes the matmul epilogue, whose support is per rank's weight)
    Case("triton_fp16_epilogue", backend="triton", dtype=torch.float16, options=dict(FEATURES, reduction="none"),
         bias=True, seed=14),
    Case("bf16", dtype=torch.bfloat16, options=dict(label_smoothing=0.1, chunk_size=8), bias=True, seed=12),
    Case("bf16_fp32_logits", dtype=torch.bfloat16, options=dict(logits_dtype=torch.float32, softcap=5.0), seed=13),
    # reduction="none" with the shard's logits kept from forward for backward
    Case("none_kept_logits", options=dict(FEATURES, reduction="none", chunk_size=4, keep_logits=True), bias=True,
         seed=15),
    Case("triton_none_kept_logits", backend="triton", options=dict(FEATURES, reduction="none", keep_logits=True),
         rank_lora=3, seed=16),
]

CASES_3 = [
    Case("plain", vocab=39),
    Case("features_mean", vocab=39, options=dict(FEATURES, chunk_size=4), bias=True, seed=20),
    Case("features_none", vocab=39, options=dict(FEATURES, reduction="none", chunk_size=5), bias=True, seed=21),
    Case("sum_scaling", vocab=39, options=dict(reduction="sum", z_loss=0.01), scaling=64.0, seed=22),
    Case("unequal", vocab=39, shards=(5, 20, 14), order=(1, 0, 2), options=dict(FEATURES), bias=True, seed=23),
    Case("labels_in_first_shard", vocab=39, labels="first_shard", options=dict(label_smoothing=0.1), seed=24),
    Case("all_ignored", vocab=39, labels="all_ignored", options=dict(reduction="sum"), bias=True),
    Case("partial_grad_input", vocab=39, options=dict(reduce_grad_input=False), bias=True, seed=25),
    Case("unequal_none_kept_logits", vocab=39, shards=(5, 20, 14), options=dict(FEATURES, reduction="none",
         keep_logits=True), bias=True, seed=26),
]

SHAPE, HIDDEN = (2, 9), 16


def shard_bounds(case: Case, world: int) -> list[tuple[int, int]]:
    """(start, size) of each rank's rows."""
    sizes = case.shards or (case.vocab // world,) * world
    assert sum(sizes) == case.vocab and len(sizes) == world, case
    order = case.order or tuple(range(world))  # rank r holds the order[r]-th slice
    by_slot = [sizes[r] for r in sorted(range(world), key=lambda r: order[r])]
    starts = [sum(by_slot[: order[r]]) for r in range(world)]
    return [(starts[r], sizes[r]) for r in range(world)]


def make_data(case: Case, world: int) -> dict[str, torch.Tensor]:
    """float64 inputs (logits of std ~3), global labels with ignored tokens, grad_output for reduction='none'."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    v, h = case.vocab, HIDDEN
    data = {
        "hidden": torch.randn(*SHAPE, h, generator=g, dtype=torch.float64),
        "weight": torch.randn(v, h, generator=g, dtype=torch.float64) * (3.0 / h**0.5),
        "bias": torch.randn(v, generator=g, dtype=torch.float64) if case.bias else None,
        "grad_output": torch.randn(*SHAPE, generator=g, dtype=torch.float64),
    }
    if case.rank_lora:
        r = case.rank_lora
        data["low_rank_input"] = torch.randn(*SHAPE, r, generator=g, dtype=torch.float64)
        data["low_rank_weight"] = torch.randn(v, r, generator=g, dtype=torch.float64) / r**0.5
    low, count = shard_bounds(case, world)[0] if case.labels == "first_shard" else (0, v)  # rank 0's rows only
    labels = torch.randint(low, low + count, SHAPE, generator=g)
    labels[torch.rand(SHAPE, generator=g) < 0.2] = IGNORE
    labels[0, 0] = IGNORE
    if case.labels == "all_ignored":
        labels.fill_(IGNORE)
    data["labels"] = labels
    return data


def run_case(case: Case, data: dict, group: Any, start: int, size: int) -> dict:
    """This rank's loss and gradients (hidden, weight shard, bias shard, u, B shard) for one case."""
    import fused_lm_loss

    def leaf(t: torch.Tensor | None, rows: bool = False) -> torch.Tensor | None:
        if t is None:
            return None
        t = t[start : start + size] if rows else t
        return t.to(case.dtype).clone().requires_grad_()

    hidden, weight, bias = leaf(data["hidden"]), leaf(data["weight"], rows=True), leaf(data["bias"], rows=True)
    low_rank = None
    if case.rank_lora:
        low_rank = (leaf(data["low_rank_input"]), leaf(data["low_rank_weight"], rows=True))
    options = dict(case.options, process_group=group)
    if case.shards is not None:
        options.update(vocab_start=start, vocab_size=case.vocab)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0) if case.grad_scaler else None
    if scaler is not None:
        options["grad_scaler"] = scaler
    kwargs = dict(num_items_in_batch=case.num_items, scaling=case.scaling, low_rank=low_rank)
    with fused_lm_loss.use_backend(case.backend):
        if case.functional:
            loss = fused_lm_loss.fused_linear_cross_entropy(hidden, weight, data["labels"], bias, **kwargs, **options)
        else:
            loss = fused_lm_loss.FusedLMLoss(**options)(hidden, weight, data["labels"], bias, **kwargs)
        if case.reduction == "none":
            loss.backward(data["grad_output"].to(loss.dtype))
        elif scaler is not None:
            scaler.scale(loss).backward()
        else:
            (loss * (case.scaling or 1.0)).backward()
    out = {"loss": loss.detach(), "hidden": hidden.grad, "weight": weight.grad}
    out["bias"] = None if bias is None else bias.grad
    if low_rank is not None:
        out["low_rank_input"], out["low_rank_weight"] = low_rank[0].grad, low_rank[1].grad
    return out


SUBGROUP_CASE = Case("subgroup", options=dict(FEATURES, chunk_size=6), bias=True, seed=30)


def vocab_parallel_worker(rank: int, world: int, cases: list[Case], with_errors: bool, subgroup: list[int]) -> dict:
    """All cases on this rank, then SUBGROUP_CASE over a group of some ranks (shards follow the group's
    ranks, not the global ones), then (optionally) the error cases and the example's check."""
    results: dict[str, Any] = {}
    for case in cases:
        start, size = shard_bounds(case, world)[rank]
        results[case.name] = run_case(case, make_data(case, world), dist.group.WORLD, start, size)
        if case.dtype == torch.bfloat16:
            # Unsharded bf16 run on the same inputs: the vocab-parallel dX should round like it.
            results[case.name]["single_hidden"] = run_case(case, make_data(case, world), None, 0, case.vocab)["hidden"]
    group = dist.new_group(subgroup)  # every rank takes part in creating it
    if rank in subgroup:
        case, group_rank = SUBGROUP_CASE, dist.get_rank(group)
        start, size = shard_bounds(case, len(subgroup))[group_rank]
        results[case.name] = run_case(case, make_data(case, len(subgroup)), group, start, size)
    if with_errors:
        results["errors"] = error_cases(rank, world)
        results["example"] = _load_example().check_vocab_parallel(torch.device("cpu"))
    return results


def error_cases(rank: int, world: int) -> dict[str, str]:
    """Mistakes that must raise the same ValueError on every rank (not hang); then a good call still works."""
    import fused_lm_loss

    case = Case("errors")
    data = make_data(case, world)
    size = case.vocab // world
    group = dist.group.WORLD

    def attempt(weight_rows: slice, labels: torch.Tensor, grad: bool = False, num_items: Any = None,
                tokens: int | None = None, **options: Any) -> str:
        weight = data["weight"][weight_rows].float()
        hidden = data["hidden"].float().reshape(-1, data["hidden"].shape[-1])[:tokens].requires_grad_(grad)
        try:
            fused_lm_loss.FusedLMLoss(process_group=group, **options)(hidden, weight, labels.reshape(-1)[:tokens],
                                                                      num_items_in_batch=num_items)
        except ValueError as error:
            return str(error)
        return "no error"

    labels = data["labels"]
    out_of_range = labels.clone()
    out_of_range[1, 1] = case.vocab
    not_replicated = labels.clone()
    if rank == 1:
        not_replicated[labels != IGNORE] = IGNORE
    shifted = labels.clone()  # the same counts and range, other classes
    if rank == 1:
        kept = labels != IGNORE
        shifted[kept] = shifted[kept].roll(1)
    out_of_range_on_one_rank = labels.clone()
    if rank == 1:
        out_of_range_on_one_rank[1, 1] = case.vocab
    # changes that cancel in a position-weighted sum: +1, -2, +1 at three neighbours (the range kept by 0 and V - 1)
    cancelling = labels.clone().reshape(-1)
    cancelling[:5] = torch.tensor([10, 10, 10, 0, case.vocab - 1])
    if rank == 1:
        cancelling[:3] = torch.tensor([11, 8, 11])
    mine = slice(rank * size, (rank + 1) * size)
    start_overlap, v = rank * (size - 2), case.vocab
    errors = {
        "label_out_of_range": attempt(mine, out_of_range),
        # equal shards (no vocab_start) but rank 0 holds one row more
        "size_mismatch": attempt(slice(0, size + 1) if rank == 0 else mine, labels),
        # rank 1's rows start 2 rows before rank 0's end
        "overlap": attempt(slice(start_overlap, start_overlap + size), labels, vocab_start=start_overlap, vocab_size=v),
        # rank 0 holds one row less: row size - 1 is nobody's
        "gap": attempt(slice(0, size - 1) if rank == 0 else mine, labels, vocab_start=rank * size, vocab_size=v),
        "labels_not_replicated": attempt(mine, not_replicated),
        "labels_differ_same_counts": attempt(mine, shifted),
        "label_changes_that_cancel": attempt(mine, cancelling),
        "no_tokens_on_one_rank": attempt(mine, labels, tokens=0 if rank == 0 else None),
        "num_items_differs": attempt(mine, labels, num_items=10 + rank),
        "num_items_invalid_on_one_rank": attempt(mine, labels, num_items=-1 if rank == 0 else 5),
        "label_out_of_range_on_one_rank": attempt(mine, out_of_range_on_one_rank),
        "options_differ": attempt(mine, labels, **({"label_smoothing": 0.1} if rank == 1 else {})),
        "chunk_size_differs": attempt(mine, labels, chunk_size=3 + rank),
        "grad_on_one_rank": attempt(mine, labels, grad=rank == 1),
    }
    errors["dtensor_weight"] = _dtensor_weight_error(data, world)
    errors["compiled"] = _compiled_error(data, group, slice(rank * size, (rank + 1) * size))
    # The ranks are still in step: a correct call afterwards works.
    start, size = shard_bounds(case, world)[rank]
    # equal options that print differently (-0.0, 0.0) are the same options
    errors["signed_zero_z_loss"] = attempt(mine, labels, z_loss=-0.0 if rank == 0 else 0.0)
    errors["then_ok"] = float(run_case(case, data, group, start, size)["loss"])
    return errors


def _compiled_error(data: dict, group: Any, rows: slice) -> str:
    """torch.compile(fullgraph=True) of a vocab-parallel loss: a clear error on every rank (the group crosses the
    operator through a registry that a trace cannot fill in), raised before any collective."""
    import fused_lm_loss

    loss_fn = fused_lm_loss.FusedLMLoss(process_group=group)
    step = torch.compile(lambda h, w, y: loss_fn(h, w, y), fullgraph=True, backend="eager")
    try:
        step(data["hidden"].float(), data["weight"][rows].float(), data["labels"])
    except Exception as error:  # noqa: BLE001 - Dynamo wraps it in an error of its own
        return str(error)
    return "no error"


def _dtensor_weight_error(data: dict, world: int) -> str:
    """A row-sharded DTensor weight (what FSDP2 / tensor parallelism hold between forwards) is refused."""
    import fused_lm_loss
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Shard as RowShard, distribute_tensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import Shard as RowShard, distribute_tensor

    weight = distribute_tensor(data["weight"].float(), init_device_mesh("cpu", (world,)), [RowShard(0)])
    try:
        fused_lm_loss.FusedLMLoss()(data["hidden"].float(), weight, data["labels"])
    except ValueError as error:
        return str(error)
    return "no error"


def _load_example():
    spec = importlib.util.spec_from_file_location("vocab_parallel_example", ROOT / "examples" / "vocab_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------
# DDP and FSDP2


class LMHeadWithLoss(nn.Linear):
    """An lm_head that computes the fused loss in its own forward, so FSDP2 has all-gathered ``weight``."""

    def __init__(self, dim: int, vocab: int, **loss_options: Any) -> None:
        super().__init__(dim, vocab, bias=False)
        import fused_lm_loss

        self.loss_fn = fused_lm_loss.FusedLMLoss(**loss_options)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        return self.loss_fn(hidden, self.weight, labels, self.bias, num_items_in_batch=num_items_in_batch)


class TinyLM(nn.Module):
    """embedding -> linear -> lm_head with the loss inside."""

    def __init__(self, vocab: int = 48, dim: int = 16, **loss_options: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.lm_head = LMHeadWithLoss(dim, vocab, **loss_options)
        with torch.no_grad():
            self.lm_head.weight.mul_(3.0 * dim**0.5)  # logits of std ~3

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(self.embed(ids)))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        return self.lm_head(self.hidden(ids), labels, num_items_in_batch)


@dataclass(frozen=True)
class DataParallelScenario:
    """Each rank's batch; ``one_rank_ignored``: rank 1's labels are all ignore_index (HF num_items_in_batch style)."""

    name: str
    one_rank_ignored: bool = False
    reduction: str = "mean"
    lr: float = 0.5

    def batches(self, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(7)
        out = []
        for rank in range(world):
            ids = torch.randint(0, 48, (2, 8), generator=g)
            labels = torch.randint(0, 48, (2, 8), generator=g)
            labels[:, :2] = IGNORE  # the same number of loss tokens per rank: mean of means = global mean
            if self.one_rank_ignored and rank == 1:
                labels.fill_(IGNORE)
            out.append((ids, labels))
        return out

    @property
    def uses_num_items(self) -> bool:
        return self.one_rank_ignored or self.reduction == "none"

    def rank_loss(
        self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, n_items: int, world: int
    ) -> torch.Tensor:
        """This rank's loss, scaled so that averaging gradients over ranks gives the global-batch gradient."""
        if self.reduction == "none":
            return model(ids, labels).sum() / n_items * world
        if self.uses_num_items:
            return model(ids, labels, n_items) * world
        return model(ids, labels)


DP_SCENARIOS = [
    DataParallelScenario("mean"),
    DataParallelScenario("one_rank_all_ignored", one_rank_ignored=True),
    DataParallelScenario("none_one_rank_all_ignored", one_rank_ignored=True, reduction="none"),
]


def data_parallel_worker(rank: int, world: int) -> dict:
    """One SGD step of TinyLM per scenario under DDP and under FSDP2 (lm_head its own unit)."""
    results: dict[str, Any] = {"ddp": {}, "fsdp": {}}
    for scenario in DP_SCENARIOS:
        results["ddp"][scenario.name] = _ddp_step(scenario, rank, world)
    fully_shard = _fully_shard()
    if fully_shard is None:
        results["fsdp"] = "fully_shard is not available in this torch"
        return results
    try:
        for scenario in DP_SCENARIOS:
            results["fsdp"][scenario.name] = _fsdp_step(fully_shard, scenario, rank, world)
    except Exception:  # noqa: BLE001 - reported to the test (a skip where FSDP2 on CPU/gloo is not known to work)
        results["fsdp"] = traceback.format_exc()
    return results


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # torch 2.5
        except ImportError:
            return None
    return fully_shard


def _global_items(batches: list) -> int:
    return sum(int((labels != IGNORE).sum()) for _, labels in batches)


def _ddp_step(scenario: DataParallelScenario, rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = TinyLM(reduction=scenario.reduction)
    ddp = DistributedDataParallel(model)
    batches = scenario.batches(world)
    ids, labels = batches[rank]
    loss = scenario.rank_loss(ddp, ids, labels, _global_items(batches), world)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=scenario.lr).step()
    return {"grads": grads, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _fsdp_step(fully_shard: Callable, scenario: DataParallelScenario, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import fused_lm_loss

    mesh = init_device_mesh("cpu", (world,))
    model = TinyLM(reduction=scenario.reduction)
    fully_shard(model.lm_head, mesh=mesh)  # lm_head is its own FSDP unit
    fully_shard(model, mesh=mesh)
    batches = scenario.batches(world)
    ids, labels = batches[rank]
    loss = scenario.rank_loss(model, ids, labels, _global_items(batches), world)
    loss.backward()
    out: dict[str, Any] = {
        "grads": {name: p.grad.full_tensor() for name, p in model.named_parameters()},
        "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
    }
    torch.optim.SGD(model.parameters(), lr=scenario.lr).step()
    out["params"] = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
    # Outside its forward, lm_head.weight is this rank's shard (a DTensor): the loss must refuse it.
    try:
        fused_lm_loss.FusedLMLoss()(torch.randn(2, 8, 16), model.lm_head.weight, labels)
        out["dtensor_error"] = "no error"
    except ValueError as error:
        out["dtensor_error"] = str(error)
    return out


def patched_fsdp2_worker(rank: int, world: int) -> dict:
    """patch() and FSDP2's fully_shard in either order, on a Llama and on a peft LoRA model: each call's loss and
    whether the fused loss ran, beside the unpatched model's (tests/integrations/test_transformers.py)."""
    import fused_lm_loss
    from fused_lm_loss.integrations import hf_forward

    fully_shard = _fully_shard()
    if fully_shard is None:
        return {"skip": "fully_shard is not available in this torch"}
    calls = []
    original = hf_forward.lm_loss
    hf_forward.lm_loss = lambda *a, **k: calls.append(1) or original(*a, **k)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))

    def step(model) -> dict:
        model.eval()  # (an attribute assignment on the swapped class, under FSDP2's subclass)
        model.train()
        before = len(calls)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return {"loss": loss.detach(), "fused": len(calls) - before}

    def lora(model):
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    out: dict[str, Any] = {"unpatched": step(_sharded(fully_shard, _tiny_llama()))}
    model = fused_lm_loss.patch(_tiny_llama())  # patch first: fully_shard then subclasses the swapped class
    fully_shard(model)
    out["patch_then_shard"] = step(model)
    try:
        fused_lm_loss.unpatch(model)
        out["unpatch_error"] = None
    except RuntimeError as error:
        out["unpatch_error"] = str(error)
    out["shard_then_patch"] = step(fused_lm_loss.patch(_sharded(fully_shard, _tiny_llama())))
    # lm_head its own unit, resharded after forward; a per-token loss makes backward recompute the logits
    model = _tiny_llama()
    fully_shard(model.lm_head)
    model = fused_lm_loss.patch(_sharded(fully_shard, model), fused_lm_loss.FusedLMLoss(reduction="none"))
    loss = model(input_ids=ids, labels=ids).loss
    try:
        (loss * torch.rand_like(loss)).sum().backward()
        out["freed_weight_error"] = None
    except RuntimeError as error:
        out["freed_weight_error"] = str(error)
    if importlib.util.find_spec("peft") is not None:
        out["lora_unpatched"] = step(_sharded(fully_shard, lora(_tiny_llama())))
        out["lora_patched"] = step(fused_lm_loss.patch(_sharded(fully_shard, lora(_tiny_llama()))))
        assigned = _sharded(fully_shard, lora(_tiny_llama()))
        assigned.loss_function = fused_lm_loss.FusedLMLoss()
        out["lora_assigned"] = step(assigned)
    return out


def _sharded(fully_shard: Callable, model: nn.Module) -> nn.Module:
    fully_shard(model)
    return model


def reference_step(scenario: DataParallelScenario, world: int) -> dict:
    """The single-process float64 step on the concatenated batch (plain PyTorch cross-entropy)."""
    model = TinyLM().double()
    batches = scenario.batches(world)
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    logits = model.hidden(ids) @ model.lm_head.weight.T
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    (loss / _global_items(batches)).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=scenario.lr).step()
    return {"grads": grads, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}



# ----------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 (tests/integrations/test_deepspeed.py)

ZERO3_CASES = ("untied", "tied", "lora", "zero2", "offload")  # the last two: ZeRO-2; ZeRO-3 offloading to CPU
ZERO3_TRL_CASES = ("logprobs", "divergence")


def _tiny_llama(tied: bool = False, seed: int = 0, device: str = "cpu"):
    import transformers

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device)


def _zero3_config(train: bool = True, case: str = "") -> dict:
    zero = {"stage": 2} if case == "zero2" else {
        # every parameter partitioned, however small (by default small ones stay whole and would hide a bug)
        "stage": 3, "stage3_param_persistence_threshold": 0}
    if case == "offload":  # parameters and optimizer state on the host (torch's SGD there, not DeepSpeed's Adam)
        zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
        "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False,
    }
    if train:
        config.update({"optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True,
                       "gradient_clipping": 0.0})  # (DeepSpeed's default clips at 1.0)
    return config


def _full_grads(engine) -> dict:
    import deepspeed

    return {n: deepspeed.utils.safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()
            if p.requires_grad}


def _gathered_params(engine) -> dict:
    import deepspeed

    params = [p for _, p in engine.module.named_parameters()]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _averaged_grads(trainable: list, world: int) -> dict:
    for _, p in trainable:
        dist.all_reduce(p.grad)
        p.grad /= world
    return {n: p.grad.clone() for n, p in trainable}


def _side_by_side(engine, reference, engine_loss: Callable, reference_loss: Callable, *, steps: int, rank: int,
                  world: int) -> tuple[dict, torch.Tensor]:
    """``steps`` SGD steps (lr 0.5) of a DeepSpeed engine and of an unpartitioned reference on the same batches
    (this rank's: 2 x 12 ids, the first 3 labels ignored; the reference's gradients averaged over the ranks, as
    DeepSpeed's reduction does). Returns each step's losses and full gradients for both, the final parameters (the
    engine's gathered), and the last labels."""
    device = next(reference.parameters()).device
    trainable = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    optimizer = torch.optim.SGD([p for _, p in trainable], lr=0.5)
    out = {"loss": [], "ref_loss": [], "grads": [], "ref_grads": []}
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + 10 * rank + step)
        ids = torch.randint(0, 96, (2, 12), generator=gen).to(device)
        labels = ids.clone()
        labels[:, :3] = -100
        loss = engine_loss(ids, labels)
        engine.backward(loss)
        out["grads"].append(_full_grads(engine))
        engine.step()
        ref_loss = reference_loss(ids, labels)
        ref_loss.backward()
        out["ref_grads"].append(_averaged_grads(trainable, world))
        optimizer.step()
        optimizer.zero_grad()
        out["loss"].append(loss.item())
        out["ref_loss"].append(ref_loss.item())
    out["params"] = _gathered_params(engine)
    out["ref_params"] = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return out, labels


def _partition_errors(engine, labels: torch.Tensor) -> dict:
    """The errors of fused calls (the loss, token_stats, fused_divergence) that meet the head's ZeRO-3 partition:
    outside any forward (they must refuse it), and in a backward that recomputes with a head gathered for forward
    only (per-token weights; DeepSpeed swaps param.data, which no version counter sees). A frozen head (LoRA)
    recomputes nothing. Also the student's gradients of a divergence whose teacher was gathered for forward only,
    beside those with the teacher gathered throughout."""
    import deepspeed

    import fused_lm_loss

    errors = {}
    weight = engine.module.get_output_embeddings().weight
    hidden, teacher = torch.randn(2, 12, 32, device=labels.device), torch.randn(96, 32, device=labels.device)
    try:
        fused_lm_loss.FusedLMLoss()(hidden, weight, labels)
    except ValueError as error:
        errors["partition_error"] = str(error)
    try:
        fused_lm_loss.fused_divergence(hidden, weight, hidden, teacher, labels)
    except ValueError as error:
        errors["divergence_partition_error"] = str(error)
    # A teacher head gathered for forward only: the student's gradients equal those of a step with the teacher
    # gathered throughout, with uniform weights (backward rescales) and per-row ones (backward recomputes: the
    # teacher, which gets no gradient, is saved as a detached alias of the gathered data, which it keeps alive).
    student = torch.randn(96, 32, device=labels.device)
    row_weights = torch.rand(2, 12, device=labels.device)
    for reduction in ("mean", "none"):
        released, whole = ([t.clone().requires_grad_(True) for t in (hidden, student)] for _ in range(2))

        def loss_of(h, w):
            out = fused_lm_loss.fused_divergence(h, w, hidden, weight, labels, reduction=reduction)
            return out if reduction == "mean" else (out * row_weights).sum()

        with deepspeed.zero.GatheredParameters([weight]):
            loss = loss_of(*released)
            loss_of(*whole).backward()
        loss.backward()
        errors[f"teacher_released_grads_{reduction}"] = ([t.grad for t in released], [t.grad for t in whole])
    if weight.requires_grad:
        with deepspeed.zero.GatheredParameters([weight]):
            logprobs = fused_lm_loss.token_stats(hidden, weight, labels).logprobs
            divergence = fused_lm_loss.fused_divergence(hidden, weight, hidden, teacher, labels, reduction="none")
        for name, per_token in (("backward_error", logprobs), ("divergence_backward_error", divergence)):
            try:  # per-token weights: backward recomputes with the head
                (per_token * torch.rand(2, 12, device=labels.device)).sum().backward()
            except RuntimeError as error:
                errors[name] = str(error)
    return errors


def zero3_worker(rank: int, world: int, cases: tuple, device: str = "cpu") -> dict:
    """Per case: a tiny Llama trained 3 SGD steps under DeepSpeed (ZeRO-3, every parameter partitioned; "zero2";
    "offload": ZeRO-3 with parameters and optimizer state on the host), patched
    with fused_lm_loss, beside an unpartitioned copy (gradients all-reduced and averaged). Returns each step's
    loss and every full gradient (DeepSpeed's, after its reduction) for both, and the final parameters. (On a GPU
    run, test_deepspeed.py runs it on one GPU: rank 0 of 1, NCCL, device "cuda".)"""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import copy

    import deepspeed

    import fused_lm_loss

    results = {}
    for case in cases:
        reference = _tiny_llama(tied=case == "tied", device=device)
        model = copy.deepcopy(reference)
        if case == "lora":
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
            model, reference = get_peft_model(model, lora), get_peft_model(reference, lora)
            reference.load_state_dict(model.state_dict())
        fused_lm_loss.patch(model)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                         if p.requires_grad],
                                          config=_zero3_config(case=case))
        out, labels = _side_by_side(engine, reference, lambda ids, labels: engine(input_ids=ids, labels=labels).loss,
                                    lambda ids, labels: reference(input_ids=ids, labels=labels).loss,
                                    steps=3, rank=rank, world=world)
        if case != "zero2":  # (ZeRO-2 keeps every parameter whole)
            out.update(_partition_errors(engine, labels))
        results[case] = out
        engine.destroy()
    return results


def zero3_trl_worker(rank: int, world: int, cases: tuple, device: str = "cpu") -> dict:
    """TRL's fused-head calls with a ZeRO-3 partitioned student head, as TRL's trainers make them (HF's ZeRO-3
    flag set, so TRL gathers the head around the call; the loss inside the model's forward):

    - "logprobs": ``model(..., fused_lm_head=True)`` (``trl.trainer.utils.add_fused_lm_head``, DPO's outputs), the
      loss a different weight per sequence on the log-probabilities plus an entropy term, so that backward
      recomputes the logits with the head's weight;
    - "divergence": the distillation trainer's ``_chunked_divergence_loss`` (JSD) through TRL's forward redirection,
      the teacher a ZeRO-3 inference engine.

    Beside the same steps unpartitioned and unpatched (TRL's own functions). Returns losses, DeepSpeed's reduced
    gradients, the final parameters, and how many calls our kernels served."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import copy

    import deepspeed
    import trl.trainer.distillation_trainer as distillation
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config
    from trl.models.utils import _ForwardRedirection
    from trl.trainer.utils import add_fused_lm_head

    import fused_lm_loss
    from fused_lm_loss.integrations import trl as trl_integration

    served = []
    for name in ("token_stats_with", "divergence_with"):
        ours = getattr(trl_integration, name)
        setattr(trl_integration, name, lambda *a, _ours=ours, **k: served.append(1) or _ours(*a, **k))
    results = {}
    for case in cases:
        reference = _tiny_llama(device=device)
        model = fused_lm_loss.patch(copy.deepcopy(reference))
        teacher = teacher_engine = None
        if case == "logprobs":
            outputs = ("log_probs", "entropy", "mean_logits", "is_top1")  # DPOTrainer's
            add_fused_lm_head(model, outputs=outputs)
            add_fused_lm_head(reference, outputs=outputs)
        else:
            teacher = _tiny_llama(seed=1, device=device)
            teacher_engine, *_ = deepspeed.initialize(model=copy.deepcopy(teacher), config=_zero3_config(train=False))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=_zero3_config())

        def step_loss(net, teacher_net, ids, labels):
            if case == "logprobs":
                out = net(input_ids=ids, labels=labels, fused_lm_head=True)
                # chosen / rejected: DPO's weights, one per sequence
                per_sequence = torch.tensor([[1.0], [-0.5]], device=ids.device)
                return -(per_sequence * out.log_probs).sum() + 0.1 * out.entropy.sum()
            with torch.no_grad():
                teacher_hidden = teacher_net.model(input_ids=ids).last_hidden_state

            def student_loss(student):
                hidden = student.model(input_ids=ids).last_hidden_state
                loss, _, _ = distillation._chunked_divergence_loss(
                    hidden, teacher_hidden, student.lm_head.weight, teacher_net.lm_head.weight, labels != -100,
                    beta=0.5, temperature=0.8)
                return loss

            if net is engine:
                return _ForwardRedirection()(engine, engine.module, student_loss, engine.module)
            return student_loss(net)

        def engine_loss(ids, labels):
            flag = HfDeepSpeedConfig(_zero3_config())  # as Trainer(deepspeed=...) sets it: TRL gathers the head
            try:
                return step_loss(engine, None if teacher_engine is None else teacher_engine.module, ids, labels)
            finally:
                unset_hf_deepspeed_config()
                del flag

        served.clear()
        out, _ = _side_by_side(engine, reference, engine_loss,
                               lambda ids, labels: step_loss(reference, teacher, ids, labels),
                               steps=2, rank=rank, world=world)
        out["served"] = len(served)
        results[case] = out
        engine.destroy()
    return results


ZERO3_TRAINER_CASES = ("trainer", "sft", "sft_lora", "dpo", "grpo", "distill")


def zero3_trainer_worker(rank: int, world: int, cases: tuple, device: str = "cpu") -> dict:
    """Per case, two runs of a trainer under ``TrainingArguments(deepspeed=<ZeRO-3 config>)``, unpatched and
    patched, from the same seeds: HF's ``Trainer`` (tied embeddings), TRL's ``SFTTrainer`` (full, and LoRA on q / v:
    the head frozen), ``DPOTrainer`` (policy and reference patched), ``GRPOTrainer`` (generation, per-token
    advantages: backward recomputes with the head) and ``DistillationTrainer`` (on-policy generation; the student
    patched). fp32, SGD, 2 steps. Returns, per case and run, the log history, the trained parameters (gathered)
    and how many calls our kernels served."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.integrations import unset_hf_deepspeed_config
    from trl.trainer.distillation_config import DistillationConfig
    from trl.trainer.distillation_trainer import DistillationTrainer

    import fused_lm_loss
    from fused_lm_loss.integrations import hf_patch
    from fused_lm_loss.integrations import trl as trl_integration

    served = []
    for name in ("token_stats_with", "divergence_with"):
        ours = getattr(trl_integration, name)
        setattr(trl_integration, name, lambda *a, _ours=ours, **k: served.append(1) or _ours(*a, **k))
    fused_call = hf_patch.FusedCall
    hf_patch.FusedCall = lambda *a, **k: served.append(1) or fused_call(*a, **k)

    vocab = {f"t{i}": i for i in range(96)}
    fast = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    fast.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=fast, pad_token="t0", eos_token="t2",
                                                     unk_token="t1")
    gen = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(3, 96, (n,), generator=gen))

    rows = {
        "trainer": {"input_ids": torch.randint(3, 96, (8, 12), generator=gen).tolist()},
        "sft": {"input_ids": torch.randint(3, 96, (8, 12), generator=gen).tolist()},
        "sft_lora": {"input_ids": torch.randint(3, 96, (8, 12), generator=gen).tolist()},
        "dpo": {"prompt": [words(5) for _ in range(8)], "chosen": [words(4) + " t2" for _ in range(8)],
                "rejected": [words(4) + " t2" for _ in range(8)]},
        "grpo": {"prompt": [words(5) for _ in range(8)]},
        "distill": {"prompt": [words(5) for _ in range(8)]},
    }
    rows["trainer"]["labels"] = rows["trainer"]["input_ids"]
    config = _zero3_config()
    config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    results = {}
    for case in cases:
        for impl in ("unpatched", "patched"):
            model = _tiny_llama(tied=case == "trainer", device=device)
            model.config.update(dict(pad_token_id=0, eos_token_id=2))
            if impl == "patched":
                fused_lm_loss.patch(model)
            common = dict(output_dir=f"{os.environ.get('TMPDIR', '/tmp')}/zero3_{case}_{impl}_{rank}", max_steps=2,
                          per_device_train_batch_size=2, learning_rate=0.5, lr_scheduler_type="constant",
                          max_grad_norm=0.0, save_strategy="no", report_to="none", logging_steps=1, seed=0,
                          dataloader_num_workers=0, dataloader_pin_memory=False, use_cpu=device == "cpu",
                          deepspeed=config)
            trl_common = dict(common, bf16=False, gradient_checkpointing=False)
            dataset = datasets.Dataset.from_dict(rows[case])
            if case == "trainer":
                trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**common),
                                               train_dataset=dataset)
            elif case in ("sft", "sft_lora"):
                from peft import LoraConfig

                lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
                lora = lora if case == "sft_lora" else None
                trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**trl_common), train_dataset=dataset,
                                         processing_class=tokenizer, peft_config=lora)
            elif case == "dpo":
                ref_model = _tiny_llama(device=device)
                ref_model.config.update(dict(pad_token_id=0, eos_token_id=2))
                if impl == "patched":
                    fused_lm_loss.patch(ref_model)
                trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=trl.DPOConfig(**trl_common),
                                         train_dataset=dataset, processing_class=tokenizer)
            elif case == "grpo":
                def reward(completions, **_):  # any reward that differs between the completions of a prompt
                    return [float(sum(map(len, c.split()))) for c in completions]

                trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, processing_class=tokenizer,
                                          args=trl.GRPOConfig(**trl_common, num_generations=2,
                                                              max_completion_length=4),
                                          train_dataset=dataset)
            else:
                teacher = _tiny_llama(seed=1, device=device)
                teacher.config.update(dict(pad_token_id=0, eos_token_id=2))
                trainer = DistillationTrainer(model=model, teacher_model=teacher, processing_class=tokenizer,
                                              args=DistillationConfig(**trl_common, max_completion_length=4),
                                              train_dataset=dataset)
            served.clear()
            trainer.train()
            results[(case, impl)] = {"logs": trainer.state.log_history, "served": len(served),
                                     "engine": type(trainer.model_wrapped).__name__,
                                     "params": _gathered_params(trainer.model_wrapped)}
            trainer.model_wrapped.destroy()
            del trainer
            unset_hf_deepspeed_config()
    return results
