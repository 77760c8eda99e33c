"""A step of decodes on the CPU as a fixed list of C calls into buffers that stay put: what a
CUDA graph does for a GPU step, done by hand.

The module path (LlamaForCausalLM.forward) wraps each decoder layer's six C calls (two norms,
four int4 linears, the rope + K/V store + attention call) and two torch ops in ~10 module calls,
argument checks and fresh output tensors. At batch 1 on SmolLM2 that is ~3 ms of a ~13 ms
forward on this project's 2-core EPYC (1 thread, in process). The plan checks the shapes once,
binds every address a step does not change, and makes the same calls with the same arguments
in the same order into the same buffers each step, which also stay in cache between steps. Its
hidden states equal the module path's bit for bit (tests/unit/test_decode_plan.py).

ModelRunner uses it for a step of decodes only (AttentionMetadata.rope_decode set: the runner
has checked the step's slots and block tables) of at most MAX_ROWS tokens, on a Llama whose
four linears per layer all go through the C int4 kernel (with bfloat16 or int8 activations) and
whose norms have the C kernel, in bfloat16. Every other step goes through the modules, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.cpu_kernels.int4_matmul import MAX_KERNEL_ROWS
from engine.cpu_kernels.paged_attention import PagedDecodeKernel
from engine.model.attention import AttentionMetadata
from engine.model.quantized_linear import KernelInt4Int8xLinear, KernelInt4Linear
from engine.model.rope import StepRope

MAX_ROWS = MAX_KERNEL_ROWS
"""Most tokens in a step the plan takes: the int4 kernel's own limit (more rows dequantize first)."""

LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""A layer's linears, in the order a decode step calls them."""

KERNEL_LINEARS = frozenset({KernelInt4Linear, KernelInt4Int8xLinear})
"""The linears the plan binds: the C int4 kernel's, with bfloat16 or int8 activations."""

Call = tuple[Callable[..., int], tuple]
"""A C function and its arguments (addresses and sizes), bound once."""


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's bound calls for one batch size (rope's are bound per step)."""

    norm_in: Call
    qkv: Call
    o: Call
    norm_post: Call
    gate_up: Call
    down: Call


class _Buffers:
    """The activations of a step of up to MAX_ROWS tokens; a step of `rows` uses the first rows,
    which are contiguous views. Made on the first step (inside the runner's inference mode)."""

    def __init__(self, model: nn.Module) -> None:
        spec = model.spec
        attn = model.model.layers[0].self_attn
        hidden, inter, width = spec.hidden_size, spec.intermediate_size, attn.q_size + 2 * attn.kv_size

        def rows_of(cols: int) -> torch.Tensor:
            return torch.empty(MAX_ROWS, cols, dtype=torch.bfloat16)

        self.x, self.residual, self.h, self.o = (rows_of(hidden) for _ in range(4))  # x: the MLP's output
        self.qkv = rows_of(width)  # [rows, q | k | v]
        self.attn = rows_of(attn.q_size)  # [rows, num_heads * head_dim]
        self.gate_up = rows_of(2 * inter)  # [rows, gate | up]
        self.silu, self.act = rows_of(inter), rows_of(inter)


class DecodePlan:
    """Forward passes of decode steps through bound C calls (see the module docstring). Runs on
    the engine thread only; not thread-safe."""

    def __init__(self, model: nn.Module, decode_kernel: PagedDecodeKernel) -> None:
        """Use build(), which says why a model does not fit."""
        self._model = model
        self._rope = decode_kernel.unchecked_rope_decode
        self._buffers: _Buffers | None = None
        self._by_rows: dict[int, list[_Layer]] = {}
        attn = model.model.layers[0].self_attn
        self._heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)

    @classmethod
    def build(cls, model: nn.Module, decode_kernel: PagedDecodeKernel | None) -> tuple[DecodePlan | None, str]:
        """(the plan, "") or (None, why this model's decode steps keep the modules)."""
        reason = _unfit(model, decode_kernel)
        return (None, reason) if reason else (cls(model, decode_kernel), "")

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step is the plan's: decodes only, checked by the runner, few enough."""
        return meta.rope_decode is not None and 0 < num_tokens <= MAX_ROWS

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """LlamaForCausalLM.forward of a step `takes` accepts: input_ids [rows] int64, cos/sin
        [rows, head_dim] float32 (rope_tables' rows at each position), one KV cache per layer.
        Returns new [rows, hidden] bfloat16 hidden states; layer_done(i) after layer i, as the
        runner's layer hooks are. Raises RuntimeError if a C call refuses its arguments."""
        rows = input_ids.shape[0]
        b = self._buffers or self._make_buffers()
        layers = self._by_rows.get(rows) or self._bind(rows)
        torch.index_select(self._model.model.embed_tokens.weight, 0, input_ids, out=b.residual[:rows])
        step_rope = StepRope.gather(cos, sin, torch.bfloat16)  # the modules' factors, [rows, 1, head_dim]
        group = meta.decodes[0]
        tables = group.block_tables
        num_heads, num_kv_heads, head_dim, scale = self._heads
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        head = (b.qkv.data_ptr(), step_rope.cos.data_ptr(), step_rope.signed_sin.data_ptr(),
                meta.slot_mapping.data_ptr())
        tail = (b.attn.data_ptr(), tables.data_ptr(), group.context_lens.data_ptr(), rows, tables.shape[1],
                num_blocks, block_size, num_kv_heads, num_heads // num_kv_heads, head_dim, scale)
        gate, up = b.gate_up[:rows].split(b.silu.shape[1], dim=1)
        silu, act, rope = b.silu[:rows], b.act[:rows], self._rope
        for i, (layer, kv) in enumerate(zip(layers, kv_caches, strict=True)):
            if layer.norm_in[0](*layer.norm_in[1]) or layer.qkv[0](*layer.qkv[1]):
                raise RuntimeError(f"layer {i}: the norm or the qkv linear refused a step of {rows} tokens")
            if rope(*head, kv.data_ptr(), *tail):
                raise RuntimeError(f"layer {i}: the decode attention could not allocate its buffers ({rows} tokens)")
            if layer.o[0](*layer.o[1]) or layer.norm_post[0](*layer.norm_post[1]) or layer.gate_up[0](*layer.gate_up[1]):
                raise RuntimeError(f"layer {i}: o_proj, the norm or gate_up refused a step of {rows} tokens")
            torch.ops.aten.silu.out(gate, out=silu)
            torch.mul(silu, up, out=act)
            if layer.down[0](*layer.down[1]):
                raise RuntimeError(f"layer {i}: down_proj refused a step of {rows} tokens")
            if layer_done is not None:
                layer_done(i)
        norm = self._model.model.norm
        out = torch.empty(rows, b.x.shape[1], dtype=torch.bfloat16)
        if norm.kernel.unchecked(b.x.data_ptr(), b.residual.data_ptr(), norm.weight.data_ptr(), out.data_ptr(),
                                 rows, out.shape[1], norm.eps):
            raise RuntimeError(f"the final norm refused a step of {rows} tokens")
        return out

    def _make_buffers(self) -> _Buffers:
        self._buffers = _Buffers(self._model)
        return self._buffers

    def _bind(self, rows: int) -> list[_Layer]:
        """Every call of a step of `rows` tokens but rope's, bound to the buffers."""
        b = self._buffers

        def norm(module, x: torch.Tensor | None, residual: torch.Tensor) -> Call:
            # no x: the first layer normalizes the embedding alone (residual stands for x)
            args = (residual.data_ptr(), 0) if x is None else (x.data_ptr(), residual.data_ptr())
            return module.kernel.unchecked, (*args, module.weight.data_ptr(), b.h.data_ptr(), rows,
                                             b.h.shape[1], module.eps)

        def linear(module: KernelInt4Linear | KernelInt4Int8xLinear, x: torch.Tensor, y: torch.Tensor) -> Call:
            return module.bound_call(x, y, rows)

        layers = []
        for i, layer in enumerate(self._model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(_Layer(
                norm_in=norm(layer.input_layernorm, None if i == 0 else b.x, b.residual),
                qkv=linear(attn.qkv_proj, b.h, b.qkv),
                o=linear(attn.o_proj, b.attn, b.o),
                norm_post=norm(layer.post_attention_layernorm, b.o, b.residual),
                gate_up=linear(mlp.gate_up_proj, b.h, b.gate_up),
                down=linear(mlp.down_proj, b.act, b.x),
            ))
        self._by_rows[rows] = layers
        return layers


def _unfit(model: nn.Module, decode_kernel: PagedDecodeKernel | None) -> str:
    """Why the plan cannot run this model's decode steps, or "" when it can."""
    if decode_kernel is None:
        return "no C decode attention kernel"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(model, "spec", None) is None or not len(layers):
        return f"{type(model).__name__} is not a Llama of decoder layers"
    embed = inner.embed_tokens.weight
    if embed.dtype != torch.bfloat16 or embed.device.type != "cpu":
        return f"weights in {embed.dtype} on {embed.device.type} (the plan runs bfloat16 on the CPU)"
    norms = [inner.norm] + [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(getattr(n, "kernel", None) is None for n in norms):
        return "norms without the C kernel"
    for name in LINEARS:
        kinds = {type(layer.get_submodule(name)) for layer in layers}
        if not kinds <= KERNEL_LINEARS:
            return f"{name} is {', '.join(sorted(k.__name__ for k in kinds))}, not the C int4 kernel's"
    return ""
