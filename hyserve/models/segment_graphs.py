"""CUDA graphs for the MLP half of every decoder layer in prefill and mixed steps (docs/ARCHITECTURE.md,
"CUDA graphs").

An eager step of a few thousand tokens launches about 2,900 kernels, and the host takes longer to launch
them than the GPU takes to run them: a 2,048-token step of the 48B shape took 113 ms for 59 ms of kernels
(an H200, 2026-12-03). The attention half of a layer stays eager: its kernels take per-sequence sizes
(varlen chunk lists, cached context lengths) from the host. What runs between two attention calls (the
residual add with the post-attention norm, the router, the expert layout, the grouped expert GEMMs, the
shared expert, the residual add with the next layer's input norm) depends only on the number of tokens,
so one graph per (layer, padded token count) replays it. The MoE's layout is built on the device at
every size (ops/moe_triton.py), so nothing in it reads back to the host.

A step of t tokens replays the smallest size n >= t of the ladder over static buffers: the residual
stream (with Block AttnRes, the running block and the banked blocks), the attention output and the next
layer's normed input. Rows t..n-1 of the inputs are zero at the start of the step; zero rows stay zero
through the norms, the attention-residual mixes and the MoE (the SiLU-GLU of zeros is zero), and attention
only ever sees rows :t. Every row of the norms and of the expert GEMMs is computed from its
own token alone, so the real rows get what an eager step of the same kernels computes; the kernel
configurations are those of n tokens (a tile size switches at some token counts, which can round bf16
differently from an eager step of t tokens).

On the CPU nothing is captured: the same buffers and padding run the segment directly, which lets CPU
tests check everything but the replay.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from hyserve.models.layers.norm import add_rms_norm

log = logging.getLogger(__name__)

MIN_SEGMENT_TOKENS = 256  # smaller steps launch few enough kernels to run eagerly
MAX_SEGMENT_TOKENS = 16384


def segment_graph_sizes(max_tokens: int) -> list[int]:
    """Multiples of 256 up to 4,096, of 512 from there, ending at min(max_tokens, MAX_SEGMENT_TOKENS) itself:
    a step pays at most 1/8 of its tokens (256 of 2,049, 512 of 4,097) as padding rows through the MoE."""
    cap = min(max_tokens, MAX_SEGMENT_TOKENS)
    if cap < MIN_SEGMENT_TOKENS:
        return []
    ladder = [*range(256, 4096, 256), *range(4096, MAX_SEGMENT_TOKENS + 1, 512)]
    return [n for n in ladder if n < cap] + [cap]


def capture_graph(run: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """run() captured as a CUDA graph in `pool`: first twice on a side stream, as torch.cuda.graph expects
    (Triton compiles, lazily built tensors), then once with host syncs made errors, because a sync inside a
    capture aborts it and can leave the CUDA context unusable. Raises RuntimeError where run cannot be
    captured (a sync, out of memory)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph


def supports(model) -> bool:
    """A Kimi model (plain residuals or Block AttnRes) run on one device."""
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "layers") and hasattr(inner, "block")


class SegmentGraphs:
    """The graphs of one model and their static buffers; `KimiModel.forward` runs a step through them when
    a size fits (`size_for`). With plain residuals the buffers hold the residual stream; with Block AttnRes
    (K3) they hold the running block (`prefix`) and every banked block, each layer's graph reading the
    blocks banked so far and banking the running block where the next block starts."""

    def __init__(self, model, sizes: list[int]):
        inner, cfg = model.model, model.config
        self.model, self.plan, self.block = model, model.kernel_plan, inner.block
        layers = len(inner.layers)
        banked = -(-layers // self.block) if self.block else 0
        per_token = cfg.hidden_size * model.dtype.itemsize * (3 + banked)
        if model.device.type == "cuda":  # the buffers come out of what the cache left: a quarter of it at most
            sizes = [n for n in sizes if n * per_token <= torch.cuda.mem_get_info()[0] // 4]
        self.sizes = sorted(sizes)
        n, dev, dtype = (self.sizes or [0])[-1], model.device, model.dtype
        self.x, self.a, self.h = (torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev) for _ in range(3))
        self.blocks = torch.zeros(banked, n, cfg.hidden_size, dtype=dtype, device=dev) if banked else None
        self.norms = [layer.input_layernorm for layer in inner.layers[1:]] + [inner.norm]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._t = self._n = 0

    def size_for(self, tokens: int, plan) -> int | None:
        """The size a step of `tokens` replays under `plan` (the captured plan only), or None: run eagerly."""
        if plan != self.plan or not self.sizes or not self.sizes[0] <= tokens <= self.sizes[-1]:
            return None
        n = self.sizes[bisect.bisect_left(self.sizes, tokens)]
        return n if self.model.device.type != "cuda" or (0, n) in self.graphs else None

    @torch.inference_mode()
    def capture(self) -> SegmentGraphs:
        """Every (layer, size) on CUDA, the largest size first (the smaller ones reuse its memory from the
        shared pool). Where a layer fails to capture (a host sync: float32 experts take the reference
        loop; out of memory), that size and every smaller one run eagerly."""
        if self.model.device.type != "cuda":
            return self
        t0, pool, held = time.perf_counter(), torch.cuda.graph_pool_handle(), torch.cuda.memory_reserved()
        for n in reversed(self.sizes):
            try:
                for i in range(len(self.norms)):
                    self.graphs[i, n] = capture_graph(lambda i=i, n=n: self._segment(i, n), pool)
            except RuntimeError as e:
                self.graphs = {k: g for k, g in self.graphs.items() if k[1] > n}
                log.warning("steps of up to %d tokens run their MLPs without CUDA graphs: %s", n,
                            str(e).splitlines()[0][:200])
                break
        torch.cuda.synchronize()
        sizes = sorted({n for _, n in self.graphs})
        log.info("captured %d MLP segment graphs in %.1f s: step sizes %s, %.2f GiB more reserved", len(self.graphs),
                 time.perf_counter() - t0, f"{sizes[0]}-{sizes[-1]} tokens" if sizes else "none",
                 (torch.cuda.memory_reserved() - held) / 2**30)
        return self

    def _segment(self, i: int, n: int) -> None:
        """Layer i from its attention output to the next layer's normed input, over rows :n of the buffers."""
        if self.block:
            return self._segment_attn_res(i, n)
        layer, norm = self.model.model.layers[i], self.norms[i]
        post = layer.post_attention_layernorm
        x, h = add_rms_norm(self.x[:n], self.a[:n], post.weight, post.eps)
        x, h = add_rms_norm(x, layer.mlp_out(h, self.plan, summed=False), norm.weight, norm.eps)
        self.x[:n].copy_(x)
        self.h[:n].copy_(h)

    def _segment_attn_res(self, i: int, n: int) -> None:
        """`KimiModel.forward`'s Block AttnRes loop from layer i's attention output to layer i+1's normed
        attention input (after the last layer, the final norm)."""
        inner, b = self.model.model, self.block
        layer = inner.layers[i]
        blocks = [self.blocks[j, :n] for j in range(i // b + 1)]  # layer 0 banked the embeddings
        prefix = self.a[:n] if i % b == 0 else self.x[:n] + self.a[:n]
        prefix = prefix + layer.ffn(layer.mlp_res(blocks, prefix), self.plan)
        if i + 1 < len(inner.layers):
            nxt = inner.layers[i + 1]
            h = nxt.self_attention_res(blocks, prefix)
            if (i + 1) % b == 0:
                self.blocks[len(blocks), :n].copy_(prefix)
            self.h[:n].copy_(nxt.input_layernorm(h))
        else:
            self.h[:n].copy_(inner.norm(inner.output_attn_res(blocks, prefix)))
        self.x[:n].copy_(prefix)

    def begin(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """A step of x's tokens over size n: the stream (with Block AttnRes, the first banked block) in, the
        padding rows zero; layer 0's normed input."""
        t = x.shape[0]
        self._t, self._n = t, n
        first = self.blocks[0] if self.block else self.x
        first[:t].copy_(x)
        first[t:n].zero_()
        self.a[t:n].zero_()
        return self.model.model.layers[0].input_layernorm(x)

    def after_attention(self, i: int, a: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP half given its attention output; the next layer's normed input (rows :t, a view
        of the static buffer that the next layer's replay overwrites)."""
        self.a[: self._t].copy_(a)
        if self.model.device.type == "cuda":
            self.graphs[i, self._n].replay()
        else:
            self._segment(i, self._n)
        return self.h[: self._t]
