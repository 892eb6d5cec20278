"""Development check (GPU): where the ``norm_gemm`` decode path (``models.norm_gemm``) departs from the default one.

Session 16's GPU suite failed ``test_engine_gpu.py::test_one_token_prefill_replays_the_decode_graph`` with the switch
on (batch 3 in bucket 4, position 0); the message was lost. This prints, for the 8B shapes in bf16 on the
``triton`` backend:

* per op and M = 1..4: the dispatcher's config and the error of ``rms_norm_linear(h, None, W)`` (qkv, gate_up) and
  ``add_linear_`` (o, down with SiLU-and-mul) against their fp32 references, eager and replayed in a CUDA graph;
* per batch 1..4: a 2-layer random 8B-shaped model's graph decode at position 0 (the one-token prefill) against the
  eager prefill, with the switch off and on, and the largest difference of the K / V cache rows at position 0.

    PYTHONPATH=src python benchmarks/diag_norm_gemm.py [--out rows.json]

Session 17 ran it at dd772cf and kept only its stdout (numbers in benchmarks/NOTES.md, session 17).
"""

from __future__ import annotations

import json

import torch

from fastdecode.bench.harness import capture_graph
from fastdecode.engine.generate import Engine
from fastdecode.engine.loader import random_model
from fastdecode.models.config import ModelConfig
from fastdecode.ops.gemm import _choose
from fastdecode.ops.norm_linear import add_linear_, add_linear_ref, rms_norm_linear, rms_norm_linear_ref

DEV = "cuda"
DT = torch.bfloat16


def _rel(got, ref):
    got, ref = got.float(), ref.float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def ops() -> list:
    rows = []
    for M in (1, 2, 3, 4):
        for name, N, K in (("qkv", 6144, 4096), ("gate_up", 28672, 4096)):
            h = (torch.randn(M, K, device=DEV) * 3).to(DT)
            w = (torch.randn(N, K, device=DEV) / K ** 0.5).to(DT)
            ref = rms_norm_linear_ref(h, None, w, eps=1e-5)
            out = torch.full((M, N), float("nan"), device=DEV, dtype=DT)
            rms_norm_linear(h, None, w, eps=1e-5, out=out, backend="triton")
            eager = _rel(out, ref)
            out.fill_(float("nan"))
            g = capture_graph(lambda: rms_norm_linear(h, None, w, eps=1e-5, out=out, backend="triton"))
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            rows.append(dict(op="rms_norm_linear", shape=name, M=M, cfg=str(_choose("triton", h, w, True)),
                             eager=eager, graph=_rel(out, ref)))
        for name, N, K, glu in (("o", 4096, 4096, False), ("down", 4096, 14336, True)):
            x = torch.randn(M, 2 * K if glu else K, device=DEV).to(DT)
            w = (torch.randn(N, K, device=DEV) / K ** 0.5).to(DT)
            r0 = (torch.randn(M, N, device=DEV) * 3).to(DT)
            ref = add_linear_ref(r0, x, w, glu=glu)
            r = r0.clone()
            add_linear_(r, x, w, glu=glu, backend="triton")
            eager = _rel(r, ref)
            g = capture_graph(lambda: add_linear_(r, x, w, glu=glu, backend="triton"))
            r.copy_(r0)
            g.replay()
            torch.cuda.synchronize()
            rows.append(dict(op="add_linear_", shape=name, M=M, cfg=str(_choose("triton", x[:, :K], w, True)),
                             eager=eager, graph=_rel(r, ref)))
    return rows


def _metrics(got, ref):
    got, ref = got.float().reshape(-1, got.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    rms = ref.pow(2).mean(-1).sqrt()
    err = ((got - ref).abs().amax(-1) / rms)
    return dict(cos=[round(c, 6) for c in cos.tolist()], err_over_rms=[round(e, 5) for e in err.tolist()],
                nan=bool(torch.isnan(got).any()))


def engine() -> list:
    rows = []
    cfg = ModelConfig.from_preset("llama-3.1-8b").replace(n_layers=2)
    for norm_gemm in (False, True):
        model = random_model(cfg, device=DEV, dtype=DT, backend="triton", max_seq_len=64, seed=1234)
        model.set_kernels(norm_gemm=norm_gemm)
        for B in (1, 2, 3, 4):
            eng_g = Engine(model, None, max_batch=4, max_seq_len=64, cuda_graph=True, batch_buckets=[1, 2, 4])
            eng_e = Engine(model, None, max_batch=4, max_seq_len=64, cuda_graph=False)
            prompts = [[int(t)] for t in torch.randint(0, cfg.vocab_size, (B,))]
            lg = eng_g.prefill(prompts).clone()
            le = eng_e.prefill(prompts)
            # the graph's decode against an eager decode at position 0 on the same path
            eng_d = Engine(model, None, max_batch=4, max_seq_len=64, cuda_graph=False)
            ld = eng_d.decode(torch.tensor([p[0] for p in prompts], device=DEV), torch.zeros(B, dtype=torch.long,
                                                                                             device=DEV))
            cache = {}
            for nm in ("k", "v"):
                cg, ce = getattr(eng_g.cache, nm), getattr(eng_e.cache, nm)
                cache[nm] = (cg[:, :B, :, 0].float() - ce[:, :B, :, 0].float()).abs().max().item()
            rows.append(dict(norm_gemm=norm_gemm, B=B, graph_vs_eager_prefill=_metrics(lg, le),
                             graph_vs_eager_decode=_metrics(lg, ld), cache_max_abs=cache))
            print(json.dumps(rows[-1]), flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write every row as JSON here")
    a = p.parse_args()
    rows = ops()
    for r in rows:
        print(json.dumps(r), flush=True)
    rows += engine()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
