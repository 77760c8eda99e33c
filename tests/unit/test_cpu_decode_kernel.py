"""The CPU decode attention kernel (engine/cpu_kernels, C built with the host's compiler) against
a float64 reference written here, and the engine's use of it.

The reference reads each sequence's slots one by one (no paging tricks) and repeats K/V per
query head, so it shares no code with the kernel or with the torch path it replaces.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.cpu_kernels import PagedDecodeKernel, check_tables, load_decode_kernel, loader, unsupported
from engine.model.attention import AttentionMetadata, DecodeGroup, paged_attention

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine keeps the torch path (tested elsewhere)")


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    k, reason = load_decode_kernel()
    assert k is not None, reason
    return k


def reference(q, cache, tables, lens, scale):
    """float64: softmax(q k^T * scale) v over each sequence's first lens[s] slots."""
    m, num_heads, head_dim = q.shape
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    out = torch.zeros(m, num_heads, head_dim, dtype=torch.float64)
    for s in range(m):
        n = int(lens[s])
        if n == 0:
            continue
        slots = [(int(tables[s, t // block_size]), t % block_size) for t in range(n)]
        k = torch.stack([cache[0, b, o] for b, o in slots]).double()  # [n, kv_heads, dim]
        v = torch.stack([cache[1, b, o] for b, o in slots]).double()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].double(), k) * scale
        out[s] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def random_case(dtype, num_heads, num_kv_heads, head_dim, lens, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, -(-max(lens) // block_size))
    num_blocks = max_blocks * len(lens) + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)  # blocks anywhere in the cache, in any order
    tables = perm[: len(lens) * max_blocks].view(len(lens), max_blocks).contiguous()
    return q, cache, tables, torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 1, 128), (32, 2, 256), (4, 2, 16), (6, 3, 48)])
def test_matches_the_float64_reference(kernel, dtype, tol, num_heads, num_kv_heads, head_dim):
    lens = [1, 15, 16, 17, 300, 2048, 5]  # within a block, block edges, many blocks
    q, cache, tables, lens_t = random_case(dtype, num_heads, num_kv_heads, head_dim, lens)
    scale = head_dim ** -0.5
    got = kernel(q, cache, tables, lens_t, scale)
    want = reference(q, cache, tables, lens_t, scale)
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.double() - want).abs().max().item()
    assert err <= tol, f"largest difference {err:.2e} > {tol:.0e}"


def test_context_zero_gives_zeros_and_others_are_untouched_by_it(kernel):
    q, cache, tables, lens = random_case(torch.float32, 9, 3, 64, [0, 40])
    got = kernel(q, cache, tables, lens, 0.125)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.allclose(got[1].double(), reference(q, cache, tables, lens, 0.125)[1], atol=2e-5)


def test_large_scores_do_not_overflow(kernel):
    """Scores in the hundreds (softmax subtracts the maximum) and far below it (e^x underflows to 0)."""
    q, cache, tables, lens = random_case(torch.float32, 4, 2, 64, [200])
    q = q * 40
    got = kernel(q, cache, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), reference(q, cache, tables, lens, 1.0), atol=1e-4)


def test_agrees_with_the_torch_path_through_paged_attention(kernel):
    """The same step with and without the kernel in the metadata: the masked SDPA path is the
    engine's other implementation, so both must give the same attention."""
    lens = [33, 160, 7]
    q, cache, tables, lens_t = random_case(torch.float32, 9, 3, 64, lens)
    block_size = cache.shape[2]
    pos = torch.arange(tables.shape[1] * block_size)
    mask = (pos[None, :] < lens_t[:, None])[:, None, None, :]
    group = DecodeGroup(torch.arange(3), tables, lens_t, mask)
    slots = torch.zeros(3, dtype=torch.int64)
    torch_out = paged_attention(q, cache, AttentionMetadata(slots, (group,), ()), 0.125)
    kernel_out = paged_attention(q, cache, AttentionMetadata(slots, (group,), (), kernel), 0.125)
    assert torch.allclose(kernel_out, torch_out, atol=2e-5)


def test_bad_arguments_are_refused(kernel):
    q, cache, tables, lens = random_case(torch.float32, 9, 3, 64, [20, 30])
    with pytest.raises(ValueError, match="dtype"):
        kernel(q.double(), cache.double(), tables, lens, 0.1)
    with pytest.raises(ValueError, match="does not fit q"):
        kernel(q, cache.to(torch.bfloat16), tables, lens, 0.1)
    with pytest.raises(ValueError, match="int64"):
        kernel(q, cache, tables.int(), lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(q.transpose(0, 1).contiguous().transpose(0, 1), cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="sequences"):
        kernel(q, cache, tables[:1], lens, 0.1)


def test_check_tables_refuses_what_would_read_outside_the_cache():
    tables = torch.tensor([[0, 5], [3, 0]])
    check_tables(tables, torch.tensor([32, 17]), num_blocks=6, block_size=16)
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 5\)"):
        check_tables(tables, torch.tensor([32, 17]), num_blocks=5, block_size=16)
    with pytest.raises(ValueError, match=r"context lengths must lie in \[0, 32\]"):
        check_tables(tables, torch.tensor([33, 17]), num_blocks=6, block_size=16)


def test_unsupported_names_the_reason():
    assert unsupported(torch.bfloat16, torch.bfloat16, 9, 3, 64) is None
    assert "float16" in unsupported(torch.float16, torch.float16, 9, 3, 64)
    assert "differs" in unsupported(torch.bfloat16, torch.float8_e4m3fn, 9, 3, 64)
    assert "head_dim 72" in unsupported(torch.float32, torch.float32, 9, 3, 72)
    assert "head_dim 512" in unsupported(torch.float32, torch.float32, 9, 3, 512)
    assert "at most 16" in unsupported(torch.float32, torch.float32, 64, 2, 64)
    assert "at most 1024" in unsupported(torch.float32, torch.float32, 2048, 128, 64)


def test_the_build_is_cached_per_source_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    cc = loader.compiler()
    source = loader.PAGED_DECODE.path.read_text()
    name = loader.library_name(source, cc)
    assert loader.library_name(source + "\n", cc) != name
    target = loader.cache_dir() / name
    loader.build(target, cc)
    assert target.exists() and not [p for p in target.parent.iterdir() if p.suffix == ".tmp"]
    before = target.stat().st_mtime_ns
    loaded = loader._load()
    assert loaded.library is not None and loaded.path == target
    assert target.stat().st_mtime_ns == before  # found, not built again


def test_without_a_compiler_the_reason_is_given(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    loaded = loader._load()
    assert loaded.library is None and "no C compiler" in loaded.reason


def test_a_failed_build_says_what_the_compiler_said(tmp_path, monkeypatch):
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fakecc 1.0; exit 0; }\necho 'error: no' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    loaded = loader._load()
    assert loaded.library is None
    assert "exited 3" in loaded.reason and "error: no" in loaded.reason
    assert not list((tmp_path / "cache" / "cpu_kernels").iterdir())  # no half-written file left


def test_the_runner_puts_every_decode_in_one_checked_group(kernel, tmp_path):
    from engine.loader.hf_loader import read_hf_spec
    from engine.runner import ModelRunner
    from tests.tiny_model import write_tiny_model

    spec = read_hf_spec(write_tiny_model(tmp_path / "tiny"))
    caches = [torch.zeros(2, 10, 4, spec.num_kv_heads, spec.head_dim)]
    runner = ModelRunner(torch.nn.Identity(), spec, caches, 4, 64, torch.device("cpu"), decode_kernel=kernel)

    class Work:
        def __init__(self, start, blocks):
            self.start_position, self.block_ids = start, blocks

    (group,) = runner._decode_groups([Work(2, [3]), Work(20, [1, 2, 4, 5, 6, 7]), Work(5, [8, 9])])
    assert group.mask is None
    assert group.context_lens.tolist() == [3, 21, 6]
    assert group.block_tables.tolist() == [[3, 0, 0, 0, 0, 0], [1, 2, 4, 5, 6, 7], [8, 9, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="block ids"):
        runner._decode_groups([Work(2, [10])])


def test_engine_greedy_tokens_equal_with_and_without_the_kernel(tmp_path):
    """A tiny float32 model: the same greedy tokens whichever attention decodes."""
    from engine import SamplingParams
    from tests.tiny_model import tiny_llm, write_tiny_model

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 9, 2, 7] * k for k in (1, 9, 40)]
    runs = []
    for on in (True, False):
        llm = tiny_llm(write_tiny_model(tmp_path / "tiny"), cpu_attention_kernel=on)
        assert (llm.engine.runner.decode_kernel is not None) == on
        runs.append([tuple(o.token_ids) for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]
