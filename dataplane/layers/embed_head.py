"""Token embedding and LM head, both split by vocabulary rows over tensor-parallel ranks.

Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the (padded) vocabulary. The
embedding sums the ranks' partial lookups; the LM head gathers the logit columns on rank 0,
which alone samples. ``ParallelLMHead`` computes logits only for the hidden rows it is given,
so the model runner passes just the rows that sample.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from twinplane.dataplane.distributed import tp_rank, tp_world_size


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab, hidden], rows split over ranks (the last shard zero-padded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, param.shape[1]):  # not the table config.json describes
            raise ValueError(f"embedding shape mismatch: expected ({self.num_embeddings}, {param.shape[1]}), "
                             f"checkpoint {tuple(loaded.shape)}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        embedded = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(embedded)
        return embedded


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [n, hidden] -> logits [n, vocab] on rank 0 (None on other ranks when tp > 1)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits[:, : self.num_embeddings]
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        if self.tp_rank != 0:
            return None
        assert parts is not None
        return torch.cat(parts, dim=-1)[:, : self.num_embeddings]
