"""Model runner: turns a scheduler plan into one forward pass and one sampling call.

Owns the device state: weights, the per-layer KV cache tensors, the host swap tensors,
RoPE tables and the per-request random generators. Nothing it returns refers to any of them.
A plan's block copies (swap out, then swap in) run before its forward pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.cpu_kernels import PagedDecodeKernel, check_slots, check_tables
from engine.device import StepThreads
from engine.huge_pages import huge_page_mode, zeros_on_huge_pages, zeros_on_small_pages
from engine.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from engine.model.decode_plan import DecodePlan
from engine.model.rope import rope_tables
from engine.model.spec import ModelSpec
from engine.sampler import Sampler, SamplingRow
from engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


_SLOW_HUGE_PAGES_S = 2.0
"""A huge-page cache that took longer than this to zero says how to start faster (small pages
zero ~3.7 GB/s here; a slower huge-page start means the kernel or the VM is finding them)."""


def allocate_kv_caches(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    huge_pages: bool = True,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer. On the
    CPU: views of one buffer, on 2 MiB pages where Linux gives them (engine.huge_pages) unless
    `huge_pages` is False."""
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    if device.type == "cpu":
        return list(_cpu_cache((spec.num_layers, *shape), dtype, huge_pages).unbind(0))
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]


def _cpu_cache(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool) -> torch.Tensor:
    """All layers' zeroed cache in one buffer, on 2 MiB pages unless `huge_pages` is False."""
    if not huge_pages:
        logger.info("KV cache on small pages (--no-cpu-kv-huge-pages)")
        return zeros_on_small_pages(shape, dtype)[0]
    started = time.perf_counter()
    whole, advised = zeros_on_huge_pages(shape, dtype)
    if advised:
        took = time.perf_counter() - started
        slow = took > _SLOW_HUGE_PAGES_S
        logger.info("KV cache on 2 MiB pages (transparent huge pages: %s), zeroed in %.1f s%s", huge_page_mode(),
                    took, " (slow to find: --no-cpu-kv-huge-pages starts on small pages)" if slow else "")
    return whole


def allocate_swap_caches(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Host tensors in the device cache's layout, one per layer; none when num_blocks is 0.
    Uninitialised (a block is written before it is read); pinned when `device` is a GPU,
    so copies to and from it go by DMA."""
    if num_blocks == 0:
        return []
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    pin = device.type == "cuda"
    return [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(spec.num_layers)]


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 caches are copied through uint8 views: CPU index kernels do not take float8."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def copy_blocks(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]
) -> None:
    """For each layer, copy block `a` of `src` into block `b` of `dst` for every (a, b)
    pair; the two sides may live on different devices. Mutates `dst` only at the b's."""
    if not pairs:
        return
    assert len(src) == len(dst), f"{len(src)} source layers, {len(dst)} destination layers"
    src_index = torch.tensor([a for a, _ in pairs], dtype=torch.int64, device=src[0].device)
    dst_index = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=dst[0].device)
    for s, d in zip(src, dst, strict=True):
        blocks = _raw(s).index_select(1, src_index).to(d.device)  # [2, len(pairs), block, heads, dim]
        _raw(d).index_copy_(1, dst_index, blocks)


LayerDone = Callable[[int], None]
"""Called on the engine thread right after layer i of a forward pass (its KV is stored)."""
StepListener = Callable[[SchedulerOutput], "LayerDone | None"]
"""Called before each forward pass with its plan; what it returns (if anything) is called after
every layer of that pass. A prefill worker streams KV layer by layer through it."""


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        device: torch.device,
        swap_caches: list[torch.Tensor] | None = None,
        step_threads: StepThreads | None = None,
        decode_kernel: PagedDecodeKernel | None = None,
    ) -> None:
        """step_threads: intra-op threads by step size (CPU); None leaves torch's setting alone.
        decode_kernel: the CPU decode attention kernel (engine.cpu_kernels); None: torch's."""
        self.model = model
        self.decode_kernel = decode_kernel
        self.decode_plan, why_not = DecodePlan.build(model, decode_kernel)
        """Decode steps as bound C calls (engine.model.decode_plan); None: every step through the modules."""
        if decode_kernel is not None:
            logger.info("CPU decode steps: %s", "bound C calls (decode plan)" if self.decode_plan is not None
                        else f"through the modules ({why_not})")
        self.step_threads = step_threads
        self._threads_now = torch.get_num_threads()
        self.spec = spec
        self.kv_caches = kv_caches
        self.swap_caches = swap_caches or []
        """Host per-layer [2, num_swap_blocks, block_size, num_kv_heads, head_dim]."""
        self.block_size = block_size
        self.device = device
        self.cos, self.sin = rope_tables(
            spec.head_dim, max_model_len, spec.rope_theta, spec.rope_scaling, device
        )
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self._step_listener: StepListener | None = None
        self._layer_done: LayerDone | None = None

    def set_step_listener(self, listener: StepListener) -> None:
        """Install the one step listener (the model's decoder layers get a forward hook then;
        a runner without a listener pays nothing). Raises ValueError where the model has no
        `model.layers` list to hook."""
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"{type(self.model).__name__} has no model.layers to report per layer")
        if self._step_listener is None:
            for i, layer in enumerate(layers):
                layer.register_forward_hook(lambda _module, _args, _out, i=i: self._after_layer(i))
        self._step_listener = listener

    def _after_layer(self, layer: int) -> None:
        if self._layer_done is not None:
            self._layer_done(layer)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        for request_id in plan.finished_ids:
            self._generators.pop(request_id, None)
        # Out before in, both before the forward pass: the plan may already have handed the
        # swapped-out device blocks to other requests whose K/V this step writes.
        copy_blocks(self.kv_caches, self.swap_caches, plan.swap_out)
        copy_blocks(self.swap_caches, self.kv_caches, plan.swap_in)
        if plan.is_empty:
            return RunnerOutput({})
        # Single-token queries (decodes) first, so they form one batched attention call.
        decodes = [w for w in plan.scheduled if len(w.token_ids) == 1]
        prefills = [w for w in plan.scheduled if len(w.token_ids) > 1]
        ordered = decodes + prefills
        self._use_threads_for(len(decodes) + sum(len(w.token_ids) for w in prefills))
        input_ids, positions, slot_mapping = self._flatten(ordered)
        meta = self._metadata(decodes, prefills, slot_mapping)
        self._layer_done = self._step_listener(plan) if self._step_listener is not None else None
        try:
            if self.decode_plan is not None and self.decode_plan.takes(meta, len(input_ids)):
                hidden = self.decode_plan.forward(input_ids, self.cos[positions], self.sin[positions], self.kv_caches,
                                                  meta, self._layer_done)
            else:
                hidden = self.model(input_ids, self.cos[positions], self.sin[positions], self.kv_caches, meta)
        finally:
            self._layer_done = None

        sample_rows, last_index, offset = [], [], 0
        for work in ordered:
            offset += len(work.token_ids)
            if work.sample:
                sample_rows.append(work)
                last_index.append(offset - 1)
        if not sample_rows:
            return RunnerOutput({})
        logits = self.model.compute_logits(hidden[torch.tensor(last_index, device=self.device)])
        out = self.sampler(logits, [self._sampling_row(w) for w in sample_rows])
        sampled_at = time.time()  # the tokens exist from here (token delivery delay starts)
        return RunnerOutput(
            sampled_token_ids={w.request_id: t for w, t in zip(sample_rows, out.token_ids, strict=True)},
            logprobs={
                w.request_id: lp
                for w, lp in zip(sample_rows, out.logprobs, strict=True)
                if lp is not None
            },
            sampled_at=sampled_at,
        )

    def _use_threads_for(self, num_tokens: int) -> None:
        if self.step_threads is None:
            return
        wanted = self.step_threads.for_step(num_tokens)
        if wanted != self._threads_now:  # only when the kind of step changes (StepThreads)
            torch.set_num_threads(wanted)
            self._threads_now = wanted

    def _sampling_row(self, work: ScheduledRequest) -> SamplingRow:
        generator = None
        if work.params.seed is not None:
            generator = self._generators.get(work.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(work.params.seed)
                self._generators[work.request_id] = generator
        return SamplingRow(
            params=work.params,
            prompt_token_ids=work.prompt_token_ids,
            output_token_ids=work.output_token_ids,
            stop_token_ids=work.stop_token_ids,
            generator=generator,
        )

    def _flatten(self, ordered: Sequence[ScheduledRequest]):
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for work in ordered:
            ids.extend(work.token_ids)
            table = work.block_ids
            for pos in range(work.start_position, work.start_position + len(work.token_ids)):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), as_tensor(slots)

    def _context_slots(self, work: ScheduledRequest, context_len: int) -> torch.Tensor:
        bs = self.block_size
        table = torch.tensor(work.block_ids, dtype=torch.int64, device=self.device)
        pos = torch.arange(context_len, device=self.device)
        return table[pos // bs] * bs + pos % bs

    def _metadata(self, decodes, prefills, slot_mapping: torch.Tensor) -> AttentionMetadata:
        groups = self._decode_groups(decodes)
        spans = []
        start = len(decodes)
        for work in prefills:
            end = start + len(work.token_ids)
            context_len = work.start_position + len(work.token_ids)
            mask = None
            if work.start_position > 0:
                q_pos = torch.arange(work.start_position, context_len, device=self.device)
                mask = torch.arange(context_len, device=self.device)[None, :] <= q_pos[:, None]
            spans.append(PrefillSpan(start, end, self._context_slots(work, context_len), mask))
            start = end
        rope_decode = None
        if self.decode_kernel is not None and groups and not spans:
            check_slots(slot_mapping, self.kv_caches[0].shape[1] * self.block_size)
            rope_decode = self.decode_kernel.rope_decode
        return AttentionMetadata(slot_mapping, groups, tuple(spans), self.decode_kernel, rope_decode)

    def _decode_groups(self, decodes) -> tuple[DecodeGroup, ...]:
        """Decodes (token i of the step is decode i) grouped by the power of two just above
        their block count, so each group pads a context to at most twice its blocks: one
        long context no longer makes every short one in the batch attend over its length."""
        bs = self.block_size
        if self.decode_kernel is not None and decodes:  # it reads each context's own length: one group
            return (self._kernel_group(decodes),)
        by_size: dict[int, list[int]] = {}
        for i, work in enumerate(decodes):
            blocks = -(-(work.start_position + 1) // bs)
            by_size.setdefault((blocks - 1).bit_length(), []).append(i)
        groups = []
        for members in by_size.values():
            contexts = [decodes[i].start_position + 1 for i in members]
            max_blocks = -(-max(contexts) // bs)
            tables = torch.tensor(
                [list(decodes[i].block_ids[:max_blocks]) + [0] * (max_blocks - min(len(decodes[i].block_ids), max_blocks))
                 for i in members], dtype=torch.int64, device=self.device)
            lens = torch.tensor(contexts, dtype=torch.int64, device=self.device)
            mask = None
            if min(contexts) != max_blocks * bs:
                pos = torch.arange(max_blocks * bs, device=self.device)
                mask = (pos[None, :] < lens[:, None])[:, None, None, :]
            index = torch.tensor(members, dtype=torch.int64, device=self.device)
            groups.append(DecodeGroup(index, tables, lens, mask))
        return tuple(groups)

    def _kernel_group(self, decodes) -> DecodeGroup:
        """Every decode in one group for the CPU kernel: tables padded with block 0 to the longest,
        no mask (the kernel stops at each context's length), checked once for all layers."""
        bs = self.block_size
        contexts = [work.start_position + 1 for work in decodes]
        max_blocks = -(-max(contexts) // bs)
        rows = [list(work.block_ids[:max_blocks]) for work in decodes]
        tables = torch.tensor([row + [0] * (max_blocks - len(row)) for row in rows], dtype=torch.int64)
        lens = torch.tensor(contexts, dtype=torch.int64)
        check_tables(tables, lens, self.kv_caches[0].shape[1], bs)
        return DecodeGroup(torch.arange(len(decodes)), tables, lens, None)
