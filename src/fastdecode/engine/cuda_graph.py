"""The whole decode step captured as one CUDA graph per batch-size bucket; prefill stays outside.

Life cycle: create (after the model and the KV cache) -> ``capture()`` once -> ``run()`` every step.
A batch of B sequences replays the graph of the smallest bucket >= B; rows B..bucket-1 are padding that
writes only to cache rows no live sequence uses. All buckets share one memory pool.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphRunner:
    def __init__(self, model, cache, buckets: Optional[Sequence[int]] = None, warmup: int = 2):
        if cache.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need the model and the KV cache on a CUDA device, got {cache.device}")
        self.model, self.cache, self.warmup = model, cache, warmup
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

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket, largest first (the first capture sizes the shared pool).

        Warm-up runs on a side stream compile the Triton kernels and settle cuBLAS workspaces, so
        nothing is compiled or tuned inside capture. They write the cache at position 0 of the
        bucket's rows, harmless before any prefill.
        """
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                for _ in range(self.warmup):
                    self.model.decode(self.tokens[:b], self.input_pos[:b], self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[b] = self.model.decode(self.tokens[:b], self.input_pos[:b], self.cache)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()

    def bucket_for(self, B: int) -> int:
        for b in self.buckets:
            if b >= B:
                return b
        raise ValueError(f"batch of {B} exceeds the largest captured bucket ({self.buckets[-1]})")

    def run(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """tokens, input_pos: [B] int64 on the device -> logits [B, V] (a view of the graph's output:
        valid until the next replay)."""
        if not self.graphs:
            raise RuntimeError("DecodeGraphRunner.run before capture()")
        B = tokens.shape[0]
        b = self.bucket_for(B)
        self.tokens[:B].copy_(tokens, non_blocking=True)
        self.input_pos[:B].copy_(input_pos, non_blocking=True)
        if b > B:
            self.tokens[B:b].zero_()
            self.input_pos[B:b].zero_()
        self.graphs[b].replay()
        return self.logits[b][:B]
