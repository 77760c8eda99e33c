import pytest
import torch
from torch import nn

from engine.model.packed_linear import PackedLinear, pack_linears, padded_rows


@pytest.mark.parametrize("rows", [1, 7, 32, 100])
def test_packed_linear_matches_f_linear_for_any_row_count(rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    packed = PackedLinear(linear.weight)
    x = torch.randn(rows, 64)
    assert packed(x).shape == (rows, 48)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-5)


def test_pack_linears_replaces_bias_free_linears_and_keeps_others():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=True), nn.Linear(8, 4, bias=False))
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Linear", "PackedLinear"]
    torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)


def test_padded_rows_keeps_small_counts_and_rounds_larger_ones_to_eight_sizes_per_octave():
    assert [padded_rows(n) for n in (1, 16, 17, 31, 32, 33, 100, 1000, 2048, 2049)] == [
        1, 16, 18, 32, 32, 36, 104, 1024, 2048, 2304]
    assert len({padded_rows(n) for n in range(1, 2049)}) == 72
    assert all(n <= padded_rows(n) <= n * 1.125 for n in range(1, 8193))


def test_packed_linear_hands_onednn_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN keeps a primitive per input shape: prompts of 300 lengths must not make 300."""
    op = torch.ops.mkldnn._linear_pointwise
    seen = set()

    def spy(x, *args):
        seen.add(x.shape[0])
        return op(x, *args)

    packed = PackedLinear(torch.randn(24, 32))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for rows in range(1, 301):
        assert packed(torch.randn(rows, 32)).shape == (rows, 24)
    assert len(seen) == 50
    assert max(seen) == 320


def test_packed_linear_padding_leaves_the_real_rows_unchanged():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    packed = PackedLinear(linear.weight)
    x = torch.randn(17, 64)  # padded to 18 rows inside
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed(x.view(1, 17, 64)), linear(x).view(1, 17, 48), rtol=1e-4, atol=1e-5)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_packed_linear_memory_levels_off_over_many_distinct_row_counts():
    """The soak's finding: 200 new prompt lengths grew the process by ~450 MB before bucketing."""
    torch.manual_seed(0)
    packed = [PackedLinear(torch.randn(o, i)) for o, i in ((1536, 576), (576, 1536))]

    def feed(counts):
        for rows in counts:
            for p in packed:
                p(torch.randn(rows, p.in_features))

    feed(range(200, 401, 25))  # every bucket of 200..400 seen once
    before = _rss_mb()
    feed(range(200, 401))
    assert _rss_mb() - before < 40, f"grew {_rss_mb() - before:.0f} MB over row counts whose buckets it had seen"
