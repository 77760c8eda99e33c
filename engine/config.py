"""Engine configuration: what the operator asks for, frozen at start-up.

Computed facts (the KV capacity, the model's shape) live in their own result types
(`engine.capacity.KVCapacity`, `engine.model.spec.ModelSpec`); nothing writes a config
after it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "fp8"]
Device = Literal["auto", "cpu", "cuda"]
Quantization = Literal["auto", "none", "gguf", "int8", "int4"]
Int4Activations = Literal["auto", "bfloat16", "int8"]

DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16", "fp8")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "gguf", "int8", "int4")
INT4_ACTIVATIONS: tuple[str, ...] = ("auto", "bfloat16", "int8")

GiB = 1 << 30
# On CPU several workers share one host, so the KV budget is a fixed size per worker,
# never a fraction of all memory, unless --gpu-memory-utilization is given explicitly.
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * GiB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""An engine step's token budget unless one is set (EngineConfig.step_tokens), except on a CPU
prefill worker (CPU_PREFILL_BATCHED_TOKENS)."""
PREFILL_LONG_PREFILL_TOKENS = 256
"""A GPU prefill worker's long_prefill_token_threshold unless one is set (EngineConfig.for_prefill_worker)."""
CPU_PREFILL_LONG_PREFILL_TOKENS = 128
CPU_PREFILL_BATCHED_TOKENS = 512
"""A CPU prefill worker's long-prompt chunk and step budget unless set (for_prefill_worker says why)."""


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (one worker process). Names follow vLLM where meanings match."""

    model: str | None = None
    """GGUF file or HF folder; None means the default model (SmolLM2-135M-Instruct GGUF)."""
    tokenizer: str | None = None
    """Tokenizer source when it differs from `model` (a GGUF file or a folder)."""
    served_model_name: str | None = None
    """Name reported to clients; defaults to the model's name."""
    dtype: DType = "auto"
    """Weights and activations dtype. auto: bfloat16 on GPU or CPUs with avx512_bf16, else float32."""
    device: Device = "auto"
    """auto: cuda when available, else cpu."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None: the model's context length."""
    block_size: int = 16
    """Tokens per KV block."""
    gpu_memory_utilization: float | None = None
    """Share of the whole GPU's memory (on CPU: of available memory) for weights + KV cache; a
    GPU budget beyond the memory free at start is refused (engine.capacity.check_budget_fits_free).
    None: 0.9 on GPU; on CPU the fixed `kv_cache_memory` default applies instead."""
    kv_cache_memory: int | None = None
    """KV cache budget in bytes; overrides gpu_memory_utilization. CPU default: 2 GiB."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks, ignoring the memory budget (tests, capacity experiments)."""
    kv_cache_dtype: KVCacheDType = "auto"
    """Element type of the KV cache; auto follows `dtype`. fp8 is e4m3 with scale 1."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks across requests by the chained hash of their tokens."""
    swap_space: float = 0
    """GiB of host memory per worker for swapped-out KV blocks (vLLM's --swap-space).
    When blocks run out, a preempted request's blocks are copied there and copied back
    later instead of being recomputed; when the pool is full, preemption recomputes.
    0: always recompute."""
    max_num_seqs: int = 256
    """Most requests in the running batch."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step; prompts longer than what is left are chunked. None: the
    role's default (`step_tokens`): DEFAULT_MAX_NUM_BATCHED_TOKENS, except on a CPU prefill
    worker, which takes CPU_PREFILL_BATCHED_TOKENS (for_prefill_worker says why)."""
    long_prefill_token_threshold: int | None = None
    """A prompt longer than this is long (vLLM's flag): each step computes at most this many of
    its tokens, and short prompts may be admitted ahead of it (max_long_partial_prefills).
    0: off (FIFO, chunks fill the step budget). None: the role's default, 0 except on a
    prefill worker, which takes PREFILL_LONG_PREFILL_TOKENS on GPU and
    CPU_PREFILL_LONG_PREFILL_TOKENS on CPU (for_prefill_worker says why)."""
    max_long_partial_prefills: int = 1
    """Most long prompts computed at once (vLLM's flag); while that many are, the next short
    waiting prompt goes ahead of a long one at the head of the queue."""
    num_threads: int | None = None
    """torch intra-op threads for this process; None: all cores of the host."""
    decode_threads: int | None = None
    """torch intra-op threads for a step of at most 4 tokens (decode at batch 1-4); None:
    num_threads, as prefill and larger batches use (engine.device.StepThreads)."""
    engine_nice: int | None = None
    """Nice steps the engine loop thread (and the torch threads it starts) runs below the rest of
    its process (Linux; 0-19). On CPU a step holds a core for tens of milliseconds, and the
    threads that move tokens (the asyncio loop and gRPC threads streaming each token, the KV
    import thread, the router and clients on the same host) would queue behind it; at a lower
    priority the step yields the core to them at once. Lowering a priority needs no privilege.
    None: ENGINE_NICE_CPU on CPU, 0 on a GPU (the step runs there). 0: off."""
    seed: int = 0
    """Seed of the default generator (requests without their own seed)."""
    cpu_packed_weights: bool = True
    """On CPU, run linears on oneDNN-packed weights (about 2x faster in float32; results
    differ from plain F.linear in the last bits). False: plain torch linears."""
    cpu_attention_kernel: bool = True
    """On CPU, decode attention runs in this project's C kernel (engine.cpu_kernels, built with
    the host's C compiler at start; it reads K/V in place from the cache blocks), for float32
    and bfloat16 caches. False, or no compiler: torch's SDPA over a copy of the blocks."""
    cpu_int4_kernel: bool = True
    """On CPU, int4 linears (--quantization int4 or gguf) run in this project's C kernel
    (engine.cpu_kernels.int4_matmul: GGUF Q4 blocks as they are, bfloat16 dot products; needs a
    C compiler and AVX512-BF16, or with int4_activations int8 AVX2). False, or neither: torch's
    int4 kernel."""
    cpu_kv_huge_pages: bool = True
    """On CPU, the KV cache is one buffer advised for 2 MiB pages (Linux transparent huge pages,
    engine.huge_pages): the decode kernel's scattered block reads miss the TLB less (0.85-0.94x
    the kernel's time here). The cost is at start: a host whose free memory is fragmented, or a
    VM whose guest memory is not backed yet, can take seconds per GiB to fault the cache in on
    huge pages. False: small pages, advised so (MADV_NOHUGEPAGE) even where the kernel's mode is
    `always`."""
    quantization: Quantization = "auto"
    """Weight-only quantization of the decoder's linears (vLLM's flag name; CPU kernels).
    auto: on CPU in bfloat16, a GGUF whose linears are all Q4_0/Q4_1 keeps its blocks (as gguf)
    when the C int4 kernel loads (cpu_int4_kernel), reading a quarter of the bytes and computing
    as int4_activations says (auto: as llama.cpp does where the CPU runs it); otherwise dense in `dtype`
    (engine/loader/quant_choice.py says why). none: dense. gguf: keep a GGUF's Q4_0/Q4_1 (int4)
    and Q8_0 (int8) blocks as they are. int4 / int8: quantize every linear at load. Quantized
    linears compute in bfloat16 (q|k|v and gate|up fused, one linear each). Embeddings stay
    dense; the lm_head is int4 only beside int4 linears from a Q4 GGUF head, else dense
    (engine/loader/quant_choice.lm_head_quantization says why)."""
    int4_activations: Int4Activations = "auto"
    """What the C int4 kernel's linears multiply their weights with (on CPU, int4 linears only).
    int8: each row of x quantized to 8 bits per group of 32 first, as llama.cpp does for its Q4
    dot products (and vLLM's GGUF kernels: the numerics a GGUF's users get elsewhere), and
    integer dot products (AVX512-VNNI, or AVX2 with FMA and F16C): about twice as fast at every
    batch size. bfloat16: x as it is, times each weight q * d + m rounded to bfloat16, the values
    a dense bfloat16 load holds (the dense model's numerics, one decode step about twice as long).
    auto: int8 where the kernel's int8 path runs, else bfloat16. Linears that are not int4
    through the C kernel ignore it, and say so in the log when it was asked for."""
    weights_cache_dir: str | None = None
    """Where dequantized GGUF weights are cached; None: $PDSERVE_CACHE_DIR or ~/.cache/pdserve."""

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("int4_activations", self.int4_activations, INT4_ACTIVATIONS)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("kv_cache_memory", "num_gpu_blocks_override", "num_threads", "decode_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.engine_nice is not None and not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be 0..19 (nice steps below the process), got {self.engine_nice}")
        if not 0 <= self.swap_space < float("inf"):  # also rejects NaN
            raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {self.swap_space}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_long_partial_prefills <= 0:
            raise ValueError(f"max_long_partial_prefills must be positive, got {self.max_long_partial_prefills}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )

    @property
    def step_tokens(self) -> int:
        """max_num_batched_tokens, or DEFAULT_MAX_NUM_BATCHED_TOKENS where it is None."""
        return DEFAULT_MAX_NUM_BATCHED_TOKENS if self.max_num_batched_tokens is None else self.max_num_batched_tokens

    def for_prefill_worker(self, on_cpu: bool | None = None) -> "EngineConfig":
        """This config with the prefill worker's defaults filled in where unset: the long-prompt
        threshold, and on CPU (`on_cpu`; None: where `device` resolves) the step budget.

        Why a prefill worker caps long prompts by default: it only prefills, one step after
        another, and a step of a whole 2k-token prompt holds every short prompt queued behind
        it for seconds; those then reach the decode worker all at once, and its batch (and
        every stream's inter-token gap) jumps. Chunks with short prompts admitted ahead keep
        short prompts' time to first token near their own prefill and let them arrive at
        decode as they came (benchmarks/disagg_vs_colocated.py).

        Why smaller steps on CPU: there a prompt token costs milliseconds (3-6 ms on the 2-core
        EPYC), so a step of 2,048 tokens (a 256-token chunk and the short prompts that waited)
        took 1.3-3 s, the short prompts that arrived meanwhile went together in the next one,
        and the decode worker's batch still jumped by 4-7 requests at a time. Steps of 512
        tokens with 128-token chunks of a long prompt keep the bunches to one or two: the
        decode ITL p99 with bursts went from 47-57 ms to 26-35 ms, the short prompts' TTFT p99
        from 5.9 s to 3.3 s (benchmarks/RESULTS.md)."""
        if on_cpu is None:
            from engine.device import resolve_device

            on_cpu = resolve_device(self.device).type == "cpu"
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            threshold = CPU_PREFILL_LONG_PREFILL_TOKENS if on_cpu else PREFILL_LONG_PREFILL_TOKENS
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = CPU_PREFILL_BATCHED_TOKENS if on_cpu else DEFAULT_MAX_NUM_BATCHED_TOKENS
        return replace(self, long_prefill_token_threshold=threshold, max_num_batched_tokens=budget)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """Build from keyword arguments, naming any that are not engine settings."""
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise TypeError(
                f"unknown engine argument(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(cls.field_names()))}"
            )
        return cls(**kwargs)  # type: ignore[arg-type]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
