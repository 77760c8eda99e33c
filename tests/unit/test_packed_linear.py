import pytest
import torch
from torch import nn

from engine.model.packed_linear import PackedLinear, pack_linears


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
