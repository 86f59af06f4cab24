"""Vocab parallelism (a tensor-parallel lm_head) over torch.distributed.

Each rank holds a contiguous shard ``W[start:start + size]`` of the (total, H) weight and the same
hidden states and global labels. The chunk loop runs on every rank in lockstep; per chunk only the
row statistics cross ranks (a few fp32 numbers per token, never logits)::

    M_i   = all_reduce_max(m_i)                       global row max
    S_i   = all_reduce_sum(s_i * exp(m_i - M_i))      global sum-exp  -> lse_i = M_i + log S_i
    z_i,t = all_reduce_sum(target logit or 0)         only the shard holding the class contributes
    sum_i = all_reduce_sum(logit sum)                 label smoothing

Each rank then writes its exact shard of dW / db, and its partial dX = G_shard @ W_shard, summed
across the group at the end unless ``reduce_grad_input=False`` (for frameworks whose
column-parallel linear all-reduces the input gradient in its own backward, as Megatron's does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .options import LossOptions


@dataclass(frozen=True)
class Shard:
    """Which part of the vocabulary this process's weight holds."""

    start: int
    size: int
    total: int
    group: Any = None
    world_size: int = 1

    @classmethod
    def of(cls, weight: torch.Tensor, opts: LossOptions) -> "Shard":
        size = weight.shape[0]
        if opts.process_group is None:
            return cls(start=0, size=size, total=size)
        import torch.distributed as dist

        group = opts.process_group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if opts.vocab_start is None:
            start, total = rank * size, size * world
        else:
            start, total = opts.vocab_start, opts.vocab_size
        if start + size > total:
            raise ValueError(f"vocab shard [{start}, {start + size}) does not fit in vocab_size={total}")
        return cls(start=start, size=size, total=total, group=group, world_size=world)

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

    def merge_stats(self, row_max, row_sumexp, target_logit, logit_sum):
        """Combine per-shard row statistics into statistics over the whole vocabulary."""
        if self.group is None:
            return row_max, row_sumexp, target_logit, logit_sum
        import torch.distributed as dist

        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=self.group)
        sums = torch.stack([row_sumexp * torch.exp(row_max - global_max), target_logit, logit_sum])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        return global_max, sums[0], sums[1], sums[2]

    def sum_partial_grad(self, grad_hidden: torch.Tensor) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=self.group)
