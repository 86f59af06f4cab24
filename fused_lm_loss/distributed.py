"""Vocab parallelism (a tensor-parallel lm_head) over torch.distributed.

Each rank of ``process_group`` holds a contiguous shard ``W[start:start + size]`` of the (V, H) lm_head
weight (and the same rows of the bias), the same hidden states and the same *global* labels. The chunk
loop runs on every rank in lockstep; per chunk only row statistics cross ranks (a few fp32 numbers per
token, never logits)::

    M_i   = all_reduce_max(m_i)                       global row max
    S_i   = all_reduce_sum(s_i * exp(m_i - M_i))      global sum-exp  -> lse_i = M_i + log S_i
    z_i,t = all_reduce_sum(target logit or 0)         only the shard holding the class contributes
    sum_i = all_reduce_sum(logit sum)                 label smoothing only

Every rank then returns the same loss (equal to the unsharded one) and writes its exact shard of dW / db.
Each rank's dX = G_shard @ W_shard is a partial sum; by default it is all-reduced at the end of the chunk
loop, so every rank returns the full dX. ``reduce_grad_input=False`` returns the partial instead, for
frameworks whose column-parallel linear all-reduces the input gradient in its own backward (Megatron-LM:
hidden that went through ``copy_to_tensor_model_parallel_region``, the input of a ``ColumnParallelLinear``).

Precision of the dX all-reduce: when ``reduce_grad_input`` is on and the inputs are bf16/fp16, the partial
dX is kept in ``accum_dtype`` (fp32 by default) and summed across ranks in it, then cast once to the
hidden dtype: the result rounds once, as on a single device, instead of once per rank and per reduction
step. This doubles the bytes of that one (N, H) all-reduce; ``accum_dtype=None`` sums in the hidden dtype,
as does CUDA with torch < 2.8 (no matmul with fp32 output from bf16/fp16 operands there).

Each call also all-gathers a few integers per rank (shard bounds, vocab size, label counts) to check
that the shards tile the vocabulary and the labels are replicated; a mistake raises the same
``ValueError`` on every rank instead of hanging a collective or returning a wrong loss.

Example (2 ranks, each holding half of a 32000-row lm_head)::

    import torch.distributed as dist
    from fused_lm_loss import FusedLMLoss

    dist.init_process_group("nccl")                  # or "gloo" on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    # rows [16000 * rank, 16000 * (rank + 1)) of the (32000, H) lm_head
    shard = torch.nn.Parameter(full_weight.chunk(world)[rank].clone())
    loss_fn = FusedLMLoss(process_group=dist.group.WORLD)
    loss = loss_fn(hidden, shard, labels)            # labels: global ids in [0, 32000); same on every rank
    loss.backward()                                  # shard.grad: its rows of dW; hidden.grad: the full dX

    # unequal shards: say where this rank's rows start and how large the whole vocabulary is
    loss_fn = FusedLMLoss(process_group=pg, vocab_start=starts[rank], vocab_size=32000)
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, fields
from typing import Any

import torch

from .options import LossOptions


@dataclass(frozen=True)
class Shard:
    """Which part of the vocabulary this process's weight holds (all of it without a process group)."""

    start: int
    size: int
    total: int
    group: Any = None
    world_size: int = 1
    merge_logit_sum: bool = True  # label smoothing needs the sum of the logits over the whole vocabulary
    reduce_grad_input: bool = True  # sum the partial dX over the group (else each rank keeps its partial)
    hidden_size: int = 0
    options_key: int = 0  # a checksum of the options and gradients that shape the chunks and collectives

    @classmethod
    def whole(cls, vocab: int) -> "Shard":
        """The whole vocabulary on this process (no vocab parallelism)."""
        return cls(start=0, size=vocab, total=vocab)

    @classmethod
    def of(cls, weight: torch.Tensor, opts: LossOptions, needs: tuple = (), num_items: Any = None) -> "Shard":
        """This rank's shard of the vocabulary (``check_layout`` then compares it, the options, the gradients the
        call makes, ``needs``, and its ``num_items_in_batch`` across ranks, so that a value one rank refuses is
        refused by all)."""
        size = weight.shape[0]
        if opts.process_group is None:
            return cls.whole(size)
        import torch.distributed as dist

        group = opts.process_group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of process_group")
        if opts.vocab_start is None:
            start, total = rank * size, size * world
        else:
            start, total = opts.vocab_start, opts.vocab_size
        return cls(
            start, size, total, group, world, merge_logit_sum=opts.label_smoothing > 0,
            reduce_grad_input=opts.reduce_grad_input, hidden_size=weight.shape[1],
            options_key=_options_key(opts, needs, None if num_items is None else float(num_items)),
        )

    def check_layout(self, labels: torch.Tensor, n_selected: int, lowest: int, highest: int) -> None:
        """With a process group: all-gather each rank's (start, size, total, hidden size, options, label counts,
        range and checksum) and raise on every rank alike (a collective; nothing without a group).

        The number of chunks, hence of collectives, follows from these numbers and from the shard width that
        every rank shares (``chunk_vocab``), so once they agree the ranks cannot fall out of step; the labels'
        checksum (``labels_checksum``) also catches labels that differ with the same counts, which would give
        each rank a different, wrong loss. (Differing hidden states are not checked.)
        """
        if self.group is None:
            return
        import torch.distributed as dist

        header = torch.tensor([self.start, self.size, self.total, self.hidden_size, self.options_key,
                               labels.numel(), n_selected, lowest, highest], dtype=torch.int64).to(labels.device)
        mine = torch.cat([header, labels_checksum(labels).view(1)])  # (the labels' device: the group's)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        layout = [t.tolist() for t in gathered]  # one host sync

        shards = ", ".join(f"rank {r}: rows [{s}, {s + n}) of {v}" for r, (s, n, v, *_) in enumerate(layout))
        if len({row[2] for row in layout}) > 1:
            raise ValueError(
                f"vocab shards disagree on the vocabulary size ({shards}); equal shards need the same number of "
                "rows on every rank, unequal shards need vocab_start and vocab_size"
            )
        end = 0
        for start, size, *_ in sorted(layout):
            end = start + size if start == end else -1  # -1: a gap or an overlap, never recovers
        if end != self.total:
            raise ValueError(f"vocab shards must tile [0, {self.total}) without gaps or overlaps, got {shards}")
        if len({row[3] for row in layout}) > 1:
            raise ValueError(f"ranks disagree on the hidden size: {[row[3] for row in layout]}")
        if len({row[4] for row in layout}) > 1:
            raise ValueError("vocab parallelism needs the same loss options on every rank (reduction, chunk_size, "
                             "label_smoothing, ...), the same num_items_in_batch and the same inputs requiring grad: "
                             "they differ between ranks")
        if len({tuple(row[5:]) for row in layout}) > 1:
            raise ValueError(
                "vocab parallelism needs the same labels (and hidden states) on every rank; (labels, non-ignored, "
                f"lowest, highest, checksum) per rank: {[tuple(row[5:]) for row in layout]}"
            )

    @property
    def chunk_vocab(self) -> int:
        """Vocab width used to size chunks: the same on every rank, so the ranks' collectives line up."""
        return self.size if self.group is None else math.ceil(self.total / self.world_size)

    def local_target(self, target: torch.Tensor) -> torch.Tensor:
        """Global class ids -> columns of this shard's weight; -1 where the class lives on another rank."""
        if self.group is None:
            return target
        local = target - self.start
        return torch.where((local >= 0) & (local < self.size), local, torch.full_like(local, -1))

    def merge_stats(
        self,
        row_max: torch.Tensor,
        row_sumexp: torch.Tensor,
        target_logit: torch.Tensor,
        logit_sum: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Combine per-shard row statistics into statistics over the whole vocabulary (two all-reduces)."""
        if self.group is None:
            return row_max, row_sumexp, target_logit, logit_sum
        import torch.distributed as dist

        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=self.group)
        parts = [row_sumexp * torch.exp(row_max - global_max), target_logit]
        sums = torch.stack(parts + [logit_sum] if self.merge_logit_sum else parts)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        return global_max, sums[0], sums[1], sums[2] if self.merge_logit_sum else logit_sum

    def sum_partial_grad(self, partial: torch.Tensor) -> torch.Tensor:
        """All-reduce (SUM) a per-token input gradient over the group, unless ``reduce_grad_input=False``."""
        if self.group is not None and self.reduce_grad_input:
            import torch.distributed as dist

            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.group)
        return partial


# The fused loss runs as a PyTorch operator (ops.py), whose arguments are tensors and plain values: a process
# group crosses it as a name. Groups are kept for the life of the process, as torch.distributed keeps them.
_groups: dict[str, Any] = {}


def group_name(group: Any) -> str | None:
    """The name under which ``group`` crosses the operator boundary (None without a group)."""
    if group is None:
        return None
    name = f"{type(group).__name__}@{id(group):x}"
    _groups[name] = group
    return name


def group_of(name: str | None) -> Any:
    """The process group registered under ``name`` by ``group_name``."""
    return None if name is None else _groups[name]


#: the options every rank must share beyond the vocabulary layout (all but the host-side scaler, the group, the class
#: weights, which vocab parallelism refuses, and the layout that check_layout compares by itself)
_NOT_IN_KEY = ("grad_scaler", "process_group", "class_weight", "vocab_start", "vocab_size")


def _options_key(opts: LossOptions, needs: tuple, num_items: float | None) -> int:
    def canonical(value: Any) -> Any:  # (-0.0 + 0.0 is 0.0: equal options print alike)
        return value + 0.0 if isinstance(value, float) else value

    values = tuple((f.name, canonical(getattr(opts, f.name))) for f in fields(opts) if f.name not in _NOT_IN_KEY)
    return zlib.crc32(repr((values, tuple(map(bool, needs)), canonical(num_items))).encode())


#: splitmix64's multipliers, as signed int64 (torch has no uint64 arithmetic)
_MIX = (0x9E3779B97F4A7C15 - 2**64, 0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64)


def labels_checksum(labels: torch.Tensor) -> torch.Tensor:
    """() int64: the sum over positions i of a non-linear mix of (i, label_i) (splitmix64's finalizer, wrapping int64
    arithmetic; arithmetic shifts), so that labels that differ do not cancel out, as they can in a position-weighted
    sum (sum_i (i + 1) label_i is unchanged by +1 at position 1 and -1 at 2 with +1 at 3)."""
    x = labels.to(torch.int64) * _MIX[0] + torch.arange(1, labels.numel() + 1, dtype=torch.int64, device=labels.device)
    x = (x ^ (x >> 30)) * _MIX[1]
    x = (x ^ (x >> 27)) * _MIX[2]
    return (x ^ (x >> 31)).sum()
