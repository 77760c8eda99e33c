"""Kernel inputs from the runner's attention metadata (pure torch, any device)."""

from __future__ import annotations

import torch


def decode_block_tables(decode_slots: torch.Tensor, decode_mask: torch.Tensor | None,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_tables int32 [num_decodes, ceil(max_context / block_size)], context_lens int32
    [num_decodes]) from AttentionMetadata's decode_slots ([num_decodes, max_context] int64)
    and decode_mask ([num_decodes, 1, 1, max_context] bool, None when nothing is padded).

    Block j of a request is the block holding its token j * block_size: the runner builds
    slot = table[p // block_size] * block_size + p % block_size (padding reads table entries
    too, so every column is a real block id). Does not mutate its inputs.
    """
    num_decodes, max_context = decode_slots.shape
    tables = torch.div(decode_slots[:, ::block_size], block_size, rounding_mode="floor")
    if decode_mask is None:
        lens = torch.full((num_decodes,), max_context, dtype=torch.int32,
                          device=decode_slots.device)
    else:
        lens = decode_mask.reshape(num_decodes, max_context).sum(dim=-1, dtype=torch.int32)
    return tables.to(torch.int32).contiguous(), lens
