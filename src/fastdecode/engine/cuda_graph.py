"""The whole decode step captured as one CUDA graph per batch-size bucket; prefill stays outside.

Life cycle: create (after the model and the KV cache) -> ``capture()`` -> ``run()`` every step. A batch of B
sequences replays the graph of the smallest bucket >= B; rows B..bucket-1 are padding that writes only to
cache rows no live sequence uses. All buckets share one memory pool.

``lazy=True``: ``run()`` captures a bucket the first time a batch needs it (at that step boundary, between two
steps, never inside another capture), so start-up captures only what is used (``fastdecode generate``: bucket 1).
Its warm-up steps then run the step being asked for, on its real inputs: they write the same cache entries as
the replay that follows (and nothing else), so the result and the cache are those of an eager capture.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from fastdecode.engine.timing import Timings, phase
from fastdecode.ops import pdl_enabled
from fastdecode.ops._common import resolve_backend

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

_pdl_graphs = 0  # decode graphs of this process captured with programmatic dependent launch on


def pdl_graphs_captured() -> int:
    """How many decode graphs (buckets, every runner's) this process has captured with programmatic dependent launch
    on. From the second on, every PDL graph of the process runs slower: ~28 us a step at 8B int4 on an H100, once and
    for good (session 47, ``benchmarks/diag_order_effect.py``; ``docs/benchmarking.md``). A benchmark row records it
    beside its time."""
    return _pdl_graphs


class DecodeGraphRunner:
    def __init__(self, model, cache, buckets: Optional[Sequence[int]] = None, warmup: int = 2, lazy: bool = False):
        if cache.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need the model and the KV cache on a CUDA device, got {cache.device}")
        self.model, self.cache, self.warmup, self.lazy = model, cache, warmup, lazy
        buckets = sorted({int(b) for b in (buckets or DEFAULT_BUCKETS) if 1 <= b <= cache.max_batch})
        if not buckets or buckets[-1] < cache.max_batch:
            buckets.append(cache.max_batch)  # every batch the cache holds has a graph
        self.buckets = buckets
        dev = cache.device
        nmax = buckets[-1]
        # static inputs shared by every bucket (a graph of bucket b reads their first b rows)
        self.tokens = torch.zeros(nmax, dtype=torch.long, device=dev)
        self.input_pos = torch.zeros(nmax, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        #: bucket -> {"warmup": s, "capture": s}: the seconds each capture took (warm-up steps, then the capture)
        self.capture_s: dict[int, dict[str, float]] = {}

    @torch.no_grad()
    def capture(self, buckets: Optional[Sequence[int]] = None, timings: Optional[Timings] = None) -> None:
        """Capture ``buckets`` (default: every bucket) not captured yet, largest first (the first capture sizes
        the shared pool). Before any prefill: the warm-up steps write position 0 of the bucket's cache rows.

        ``timings`` (``engine.timing``): ``kernel_warmup`` (the warm-up steps: Triton compiles or cache loads,
        cuBLAS set-up) and ``graph_capture``."""
        todo = sorted(set(self.buckets if buckets is None else buckets), reverse=True)
        bad = [b for b in todo if b not in self.buckets]
        if bad:
            raise ValueError(f"bucket {bad[0]} is not one of this runner's buckets {self.buckets}")
        for b in todo:
            if b not in self.graphs:
                self._capture(b, timings)

    def _capture(self, b: int, timings: Optional[Timings] = None) -> None:
        """Warm-up steps on a side stream (so nothing is compiled or tuned inside the capture), then the capture
        of bucket ``b``; both read the static inputs' first ``b`` rows as they are."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"cannot capture the decode graph of bucket {b} inside another CUDA graph capture; "
                               "capture it first (DecodeGraphRunner.capture)")
        t0 = time.perf_counter()
        with phase(timings, "kernel_warmup"):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):
                    self.model.decode(self.tokens[:b], self.input_pos[:b], self.cache)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        with phase(timings, "graph_capture"):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[b] = self.model.decode(self.tokens[:b], self.input_pos[:b], self.cache)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
            if self._launches_pdl():
                global _pdl_graphs
                _pdl_graphs += 1
            torch.cuda.synchronize()
        self.capture_s[b] = {"warmup": t1 - t0, "capture": time.perf_counter() - t1}

    def _launches_pdl(self) -> bool:
        """The graph just captured holds PDL launches: the switch as it was while capturing, and the model's ops
        resolved to fastdecode's Triton kernels (``ops._common.resolve_backend``; "ref" is plain PyTorch)."""
        b = getattr(self.model, "backend", "auto")
        return (b != "ref" and pdl_enabled(self.tokens)
                and resolve_backend(None if b == "auto" else b, self.tokens.device, "decode graph") == "triton")

    def bucket_for(self, B: int) -> int:
        for b in self.buckets:
            if b >= B:
                return b
        raise ValueError(f"batch of {B} exceeds the largest captured bucket ({self.buckets[-1]})")

    def run(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens, input_pos: [B] int64 on the device -> logits [B, V] (a view of the graph's output:
        valid until the next replay). Lazy: a bucket not captured yet is captured first, on these inputs."""
        B = tokens.shape[0]
        b = self.bucket_for(B)
        if b not in self.graphs and not self.lazy:
            raise RuntimeError("DecodeGraphRunner.run before capture()" if not self.graphs else
                               f"DecodeGraphRunner.run: bucket {b} was not captured (captured: {sorted(self.graphs)})")
        self.tokens[:B].copy_(tokens, non_blocking=True)
        self.input_pos[:B].copy_(input_pos, non_blocking=True)
        if b > B:
            self.tokens[B:b].zero_()
            self.input_pos[B:b].zero_()
        if b not in self.graphs:
            with torch.no_grad():
                self._capture(b)
        self.graphs[b].replay()
        return self.logits[b][:B]
