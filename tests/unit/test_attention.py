"""The engine's CPU paged attention (engine.model.attention) against dense float64 attention
over the same context: decode groups with grouped-query heads (the query heads of each KV
head are folded into SDPA's query axis), padded groups, a step with several groups, and the
model's own dtype (float32 tight, float16 and bfloat16 within their rounding)."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import AttentionMetadata, DecodeGroup, paged_attention
from tests.unit.test_kernel_references import dense_attention, scattered_cache

BLOCK = 8


def decode_group(members, contexts, tables):
    """The group the runner builds for decodes `members` (rows of `tables`)."""
    lengths = torch.tensor([contexts[i] for i in members])
    width = -(-int(lengths.max()) // BLOCK)
    rows = tables[members, :width].long()
    mask = None
    if int(lengths.min()) != width * BLOCK:
        pos = torch.arange(width * BLOCK)
        mask = (pos[None, :] < lengths[:, None])[:, None, None, :]
    return DecodeGroup(torch.tensor(members), rows, lengths, mask)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (6, 1)])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("grouping", ["one group", "two groups"])
def test_decode_attention_equals_dense_attention(num_heads, num_kv_heads, dtype, tolerance, grouping):
    contexts = [3, 40, 16, 97, 1]
    cache, tables, dense = scattered_cache(contexts, num_kv_heads, 16, BLOCK, 40, seed=5)
    cache = torch.nan_to_num(cache)  # padding slots are read (and masked)
    q = torch.randn(len(contexts), num_heads, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    members = [[0, 1, 2, 3, 4]] if grouping == "one group" else [[0, 2, 4], [1, 3]]
    groups = tuple(decode_group(m, contexts, tables) for m in members)
    meta = AttentionMetadata(torch.zeros(len(contexts), dtype=torch.int64), groups, ())

    out = paged_attention(q.to(dtype), cache.to(dtype), meta, 0.3)

    assert out.dtype == dtype and out.shape == q.shape
    for s, kv in enumerate(dense):
        k, v = (x.to(dtype).double() for x in kv)  # the inputs as the engine holds them
        expected = dense_attention(q[s].to(dtype).double(), k, v, 0.3)
        torch.testing.assert_close(out[s].double(), expected, rtol=tolerance, atol=tolerance)
