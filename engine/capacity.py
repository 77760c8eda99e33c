"""KV capacity, computed: blocks x block size = tokens, and the concurrency that gives.

Pure arithmetic (no torch), shared by running workers and `pdserve plan`, so both print
the same numbers for the same settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from engine.model.spec import ModelSpec

KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str) -> int:
    """K and V of every layer for one token."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * KV_DTYPE_BYTES[kv_dtype]


INT4_GROUP_SIZE = 32  # engine.model.quantized_linear's group (a GGUF block); kept torch-free here
_SCALE_BYTES = 2  # quantized linears keep scales/zeros in their compute dtype: bfloat16 or float16


def linear_params(spec: ModelSpec) -> tuple[int, int]:
    """(weights, output rows) of the decoder layers' linears: what --quantization quantizes."""
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return spec.num_layers * per_layer, spec.num_layers * (q + 2 * kv + h + 2 * i + h)


HEADS = ("dense", "int4", "q8_0")
"""How a worker holds the output projection (engine.loader.quant_choice.lm_head_quantization)."""


def head_bytes(spec: ModelSpec, head: str) -> int:
    """Bytes of the output projection held as `head`'s blocks: int4 half a byte a weight plus a
    float16 (d, m) pair per 32; q8_0 one byte plus a float16 d per 32 (GGUF's Q8_0 block). 0 for
    dense (counted with the dense parameters)."""
    weights = spec.vocab_size * spec.hidden_size
    if head == "int4":
        return weights // 2 + (weights // INT4_GROUP_SIZE) * 2 * _SCALE_BYTES
    if head == "q8_0":
        return weights + (weights // INT4_GROUP_SIZE) * _SCALE_BYTES
    if head == "dense":
        return 0
    raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")


def weights_bytes(spec: ModelSpec, dtype: str, quantization: str = "none", head: str = "dense") -> int:
    """Bytes of the weights as a worker holds them. Embeddings and norms are dense in `dtype`;
    with int4 / int8 the decoder linears take half a byte (plus a bfloat16 scale and zero per 32
    weights) / one byte (plus a bfloat16 scale per row) a weight. The output projection is dense
    unless `head` says it keeps a GGUF's blocks: then a tied head adds them beside the dense
    token embedding, and an untied one holds them instead of its dense copy."""
    blocks = head_bytes(spec, head)
    if blocks and not spec.tie_word_embeddings:
        blocks -= spec.vocab_size * spec.hidden_size * KV_DTYPE_BYTES[dtype]
    if quantization in ("none", "auto"):
        return spec.num_params * KV_DTYPE_BYTES[dtype] + blocks
    linear, rows = linear_params(spec)
    dense = (spec.num_params - linear) * KV_DTYPE_BYTES[dtype] + blocks
    if quantization == "int4":
        return dense + linear // 2 + (linear // INT4_GROUP_SIZE) * 2 * _SCALE_BYTES
    if quantization == "int8":
        return dense + linear + rows * _SCALE_BYTES
    raise ValueError(f"quantization must be none, int8 or int4 here, got {quantization!r}")


def kv_dtype_name(kv_cache_dtype: str, dtype: str) -> str:
    """The KV element type in capacity math: `auto` follows the model dtype."""
    return dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def resolve_max_model_len(spec: ModelSpec, wanted: int | None) -> int:
    """`wanted`, or the model's context length when None. Raises ValueError past that length."""
    limit = spec.max_position_embeddings
    length = wanted or limit
    if length > limit:
        raise ValueError(f"max_model_len={length} is longer than the model's context length ({limit})")
    return length


@dataclass(frozen=True)
class KVBudget:
    """How many bytes the KV cache may take, and which setting decided it."""

    num_bytes: int | None
    """None: the block count is fixed by num_gpu_blocks_override instead."""
    source: str
    """The deciding setting in words, e.g. "--kv-cache-memory" or "0.9 x 80.0 GiB - 256.5 MiB weights"."""


def kv_budget(
    config: EngineConfig, device_type: str, weights: int, device_memory: Callable[[], int]
) -> KVBudget:
    """The KV budget rule, shared by EngineCore and `pdserve plan` so the two cannot drift.

    `weights` is the weights' size in bytes; `device_memory()` returns the bytes the device had
    before the weights were loaded, and is called only when the budget is a share of it (so a
    worker reads device memory only then). Pure apart from that call; raises nothing.
    """
    if config.num_gpu_blocks_override is not None:
        return KVBudget(None, "--num-gpu-blocks-override")
    if config.kv_cache_memory is not None:
        return KVBudget(config.kv_cache_memory, "--kv-cache-memory")
    if device_type == "cpu" and config.gpu_memory_utilization is None:
        # Several workers share one host on CPU: a fixed size each, never a share of all memory.
        return KVBudget(DEFAULT_CPU_KV_CACHE_MEMORY, "CPU default --kv-cache-memory")
    share = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    total = device_memory()
    # The share covers weights + KV (vLLM's meaning), and the weights sit in the same memory.
    return KVBudget(
        max(int(total * share) - weights, 0),
        f"{share:g} x {format_bytes(total)} - {format_bytes(weights)} weights",
    )


def check_budget_fits_free(budget: KVBudget, free: int, device: str) -> None:
    """On a GPU the share is of the whole memory (vLLM's meaning), so what others hold is not
    counted: a budget beyond the memory free now (the weights already loaded) ends the start
    here, with the numbers, instead of an out-of-memory error while allocating the cache (two
    workers of one `pdserve up` share a GPU; the launcher splits the default share between them)."""
    if budget.num_bytes is not None and budget.num_bytes > free:
        raise ValueError(
            f"the KV cache budget ({format_bytes(budget.num_bytes)} = {budget.source}) is more than the "
            f"{format_bytes(free)} free on {device}: other processes hold the rest; lower "
            "--gpu-memory-utilization (its share is of the whole GPU, and workers sharing a GPU need "
            "shares that add up to at most ~0.9), or set --kv-cache-memory")


def format_bytes(n: int) -> str:
    """Binary units with one decimal: 1536 -> '1.5 KiB', 3 * 2**30 -> '3.0 GiB'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_request(self) -> int:
        """Blocks a request of max_model_len tokens holds."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len requests fit at once (vLLM's "Maximum concurrency")."""
        return self.num_tokens / self.max_model_len

    def log_line(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} = {self.num_tokens:,} tokens "
            f"({_kib(self.bytes_per_token)}/token); max concurrency at "
            f"{self.max_model_len:,} tokens/request: {self.max_concurrency:.1f}x"
        )


def _kib(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n / 1024:.1f} KiB"


def blocks_for_budget(budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    return max(budget_bytes // (bytes_per_token * block_size), 0)


class KVCacheTooSmall(ValueError):
    """Not even one max_model_len request fits the KV cache: a setting to change, not a bug.
    The message gives the numbers and the flags; commands print it as one line, no traceback."""


def plan_capacity(
    spec: ModelSpec,
    *,
    kv_dtype: str,
    block_size: int,
    max_model_len: int,
    kv_budget_bytes: int | None,
    num_blocks_override: int | None = None,
) -> KVCapacity:
    """Capacity for a budget (or an exact block count). Raises KVCacheTooSmall, with the
    numbers and what to change, when not even one max_model_len request fits."""
    per_token = kv_bytes_per_token(spec, kv_dtype)
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    else:
        assert kv_budget_bytes is not None, "plan_capacity needs a budget or a block count"
        num_blocks = blocks_for_budget(kv_budget_bytes, per_token, block_size)
    capacity = KVCapacity(num_blocks, block_size, per_token, max_model_len)
    if num_blocks < capacity.blocks_per_request:
        need = capacity.blocks_per_request
        lower = (
            f", or lower --max-model-len to at most {capacity.num_tokens:,}" if capacity.num_tokens else ""
        )
        raise KVCacheTooSmall(
            f"KV cache too small: {num_blocks} blocks x {block_size} = {capacity.num_tokens:,} tokens "
            f"({_kib(per_token)}/token) cannot hold one request of max_model_len={max_model_len:,} "
            f"tokens, which needs {need} blocks ({need * capacity.bytes_per_block / 2**20:,.1f} MiB). "
            f"Raise --kv-cache-memory / --gpu-memory-utilization / --num-gpu-blocks-override{lower}."
        )
    return capacity
