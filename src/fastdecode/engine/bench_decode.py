"""Decode benchmark: the standard decode-latency method and the ablation of what makes it fast.

Method: a prompt of ``input_len`` random tokens, then ``output_len`` greedy tokens, repeated ``iters``
times after a warm-up; we report the median. Rows (one per implementation):

* ``torch-eager``      the model with every op on its PyTorch backend, launched eagerly
* ``torch-graph``      the same ops, the decode step replayed as one CUDA graph
* ``torch-compile``    the plain-PyTorch model (``*_ref`` functions, no custom ops) under
                       ``torch.compile(mode="reduce-overhead")``
* ``peer-compile``     the compiled peer of the same format (``fastdecode.bench.peers``): a gpt-fast-style Llama
                       (static KV cache of its own, SDPA, ``F.linear`` / FP8 ``_scaled_mm`` per-tensor / int4
                       tinygemm) on the model's weights, its greedy decode step under
                       ``torch.compile(mode="reduce-overhead", fullgraph=True)``; ``peer-eager``: the same, uncompiled
* ``fastdecode-graph`` fastdecode's Triton kernels, the decode step replayed as one CUDA graph
  (``-cublas``: every GEMM on cuBLAS; ``-triton``: every GEMM on the skinny Triton kernels)

With ``peer-compile`` measured, every ``fastdecode-*`` row gets ``speedup_vs_peer`` (its tokens/s over the
peer's). Peer rows carry ``peer`` (what the peer is) and their own ``step_weight_bytes`` (the peer's tensors:
per-tensor FP8 scales, tinygemm's bf16 scale + zero per group). The peer prefills eagerly, like ``torch-compile``.

``median_us`` is the median per-token decode step (prefill excluded); ``tokens_per_s`` is
``batch * output_len / (prefill + decode time)`` (the standard figure); ``tbps`` is the bytes one step
must read over the step time: ``step_weight_bytes`` (``model.decode_step_bytes(batch)``: every block weight,
the final norm and the lm head once, but only ``batch`` rows of the embedding table; tied embeddings: the
table once) plus the live KV cache; ``roofline_tokens_per_s`` is what the GPU's peak bandwidth would allow
for ``step_weight_bytes`` alone.

Ablation (``--ablate``): ``fastdecode-graph`` with one switch off at a time (``model.set_kernels``):
``-no-fused_norm`` (plain PyTorch add + RMSNorm, and a separate FP8 quantisation under ``--quant fp8``),
``-no-fused_act``, ``-no-skinny_gemm`` (cuBLAS / ``_scaled_mm``), ``-no-fused_allreduce`` (NCCL all-reduce,
then the norm; TP only), ``-no-int4_gemm`` (the int4 projections dequantised into a scratch weight, then
cuBLAS; int4 models only), and ``fastdecode-eager`` (no CUDA graph).

``--quant fp8`` quantises the random-weight model (W8A8), ``--quant int4`` to W4A16 (RTN, group 128; a
checkpoint path loads as stored when it is int4 already: GPTQ, AWQ, GGUF Q4_0 / Q4_1); ``--tp N`` runs under
torchrun with N ranks (rank 0 reports; ``step_weight_bytes`` are per rank, the packed int4 bytes for int4).

On a CPU only ``torch-eager`` and ``peer-eager`` run (wall-clock timing); the others are reported as skipped;
under ``--tp`` the peers are skipped (single-device models).

``--out`` merges the measured rows into the file (``merge_rows``): a run replaces the rows of the same
measurement (``row_key``) and keeps the others, so a partial run does not wipe committed results. Rows without
a measurement (failed: ``error``; skipped; no ``tokens_per_s``) are printed but never written. Without ``--out``
a CUDA run writes ``benchmarks/results/decode.json`` (``DEFAULT_OUT``); a CPU run writes no file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from fastdecode.models.llama import KERNELS
from fastdecode.quant.formats import METHODS

IMPLS = ("torch-eager", "torch-graph", "torch-compile", "peer-compile", "fastdecode-graph-cublas", "fastdecode-graph")
# not in the default list: every GEMM through the skinny Triton kernels (the table's best Triton config), and
# the peer uncompiled (slow on a GPU; what runs on a CPU)
EXTRA_IMPLS = ("fastdecode-graph-triton", "peer-eager")
PEER_IMPLS = ("peer-compile", "peer-eager")
CPU_IMPLS = ("torch-eager", "peer-eager")
ABLATIONS = ("fastdecode-eager",) + tuple(f"fastdecode-graph-no-{k}" for k in KERNELS)
# Peak HBM bandwidth by GPU name fragment, bytes/s (vendor figures); the copy anchor is 4.24 TB/s on H200
PEAK_BW = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
           "A100": 2.0e12}


def peak_bandwidth(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for k, v in PEAK_BW.items():
        if k in name:
            return v
    return None


class _Runner:
    """One implementation: prefill and a decode step that returns the next tokens (greedy, on device)."""

    def __init__(self, impl: str, model, cache, batch: int):
        self.impl, self.model, self.cache, self.batch = impl, model, cache, batch
        self.graphs = None
        self.compiled = None
        dev = cache.device
        model.set_kernels(**dict.fromkeys(KERNELS, True))  # also resets the GEMM impl (skinny_gemm on)
        if impl.startswith("fastdecode-graph-no-"):
            k = impl[len("fastdecode-graph-no-"):]
            if k not in KERNELS:
                raise ValueError(f"unknown ablation {impl!r}")
            model.backend = "triton"
            model.set_kernels(**{k: False})
        elif impl == "fastdecode-eager":
            model.backend = "triton"
        elif impl in ("torch-eager", "torch-graph"):
            model.backend = "torch"
        elif impl == "torch-compile":
            model.backend = "ref"
            # the cache is mutated in place: give it a static address, as a module buffer would have,
            # so that cudagraph trees keep (rather than skip) the graph
            torch._dynamo.reset()  # a clean cache for this model's decode (see _PeerRunner)
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
            self.compiled = torch.compile(model.decode, mode="reduce-overhead", fullgraph=True)
        elif impl in ("fastdecode-graph", "fastdecode-graph-cublas", "fastdecode-graph-triton"):
            model.backend = "triton"
            # ablation: every fastdecode kernel, with the GEMMs on cuBLAS or through the dispatcher
            model.set_gemm_impl("cublas" if impl.endswith("-cublas") else ("triton" if impl.endswith("-triton") else None))
        else:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "torch-graph" or impl.startswith("fastdecode-graph"):  # every *-graph* row replays a graph
            if dev.type != "cuda":
                raise RuntimeError(f"{impl} needs a CUDA device")
            from fastdecode.engine.cuda_graph import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(model, cache, buckets=[batch])
            self.graphs.capture()

    def step(self, tokens, pos):
        if self.graphs is not None:
            logits = self.graphs.run(tokens, pos)
        elif self.compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
            logits = self.compiled(tokens, pos, self.cache)
        else:
            logits = self.model.decode(tokens, pos, self.cache)
        return torch.argmax(logits, dim=-1)

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [B, S] -> the first new tokens [B] (greedy, on device)."""
        B, S = prompt.shape
        logits = self.model.prefill(prompt, self.cache, last_idx=torch.full((B,), S - 1, device=prompt.device))
        return torch.argmax(logits, dim=-1)

    def generate(self, prompt: torch.Tensor, output_len: int):
        """prompt: [B, S] on device. Returns (prefill seconds, decode seconds); no host sync inside."""
        B, S = prompt.shape
        cuda = prompt.device.type == "cuda"
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
        else:
            t0 = time.perf_counter()
        tok = self.prefill(prompt)
        pos = torch.full((B,), S, dtype=torch.long, device=prompt.device)
        if cuda:
            ev[1].record()
        else:
            t1 = time.perf_counter()
        for _ in range(output_len - 1):  # the prefill produced the first new token
            tok = self.step(tok, pos)
            pos += 1
        if cuda:
            ev[2].record()
            ev[2].synchronize()
            return ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3
        return t1 - t0, time.perf_counter() - t1


class _PeerRunner(_Runner):
    """The peer (``fastdecode.bench.peers.PeerLlama``): eager prefill; its greedy decode step eager
    (``peer-eager``) or under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (``peer-compile``).
    The generate loop and its timing are ``_Runner``'s."""

    def __init__(self, impl: str, peer, batch: int):
        self.impl, self.model, self.batch = impl, peer, batch
        self.graphs = self.compiled = None
        if impl == "peer-compile":
            if peer.rope.device.type != "cuda":
                raise RuntimeError(f"{impl} needs a CUDA device")
            for t in peer.kv_buffers():  # module buffers mutated in place: keep their addresses in the graph
                torch._dynamo.mark_static_address(t)
            # dynamo keys its cache on decode_step's code, shared by every peer this process built (one per
            # format and run): past 8 entries fullgraph=True fails hard (seen in the GPU suite). The runners run
            # one after another, so each compiles from a clean cache.
            torch._dynamo.reset()
            self.compiled = torch.compile(peer.decode_step, mode="reduce-overhead", fullgraph=True)
        elif impl != "peer-eager":
            raise ValueError(f"peer impl must be one of {PEER_IMPLS}, got {impl!r}")

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self.model.prefill(prompt), dim=-1)

    def step(self, tokens, pos):
        if self.compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
            # the graph's output is overwritten by its next replay, which takes it as input: a copy, as
            # gpt-fast's generate loop makes
            return self.compiled(tokens, pos).clone()
        return self.model.decode_step(tokens, pos)


def add_speedup_vs_peer(rows: list[dict]) -> None:
    """In place: ``speedup_vs_peer`` (tokens/s over the measured ``peer-compile`` row's) on every measured
    ``fastdecode-*`` row; nothing without a measured peer. Rows of one batch size (one ``bench_decode`` call)."""
    peer = next((r for r in rows if r.get("impl") == "peer-compile" and r.get("tokens_per_s")), None)
    if peer is None:
        return
    for r in rows:
        if r.get("impl", "").startswith("fastdecode") and r.get("tokens_per_s"):
            r["speedup_vs_peer"] = round(r["tokens_per_s"] / peer["tokens_per_s"], 3)


def _try_build_peer(model, quant, batch: int, max_seq: int):
    """``(peer, None)`` or ``(None, "Type: message")``."""
    from fastdecode.bench.peers import build_peer

    try:
        return build_peer(model, quant, batch, max_seq), None
    except Exception as e:  # reported on the peer's rows; the other rows still run
        return None, f"{type(e).__name__}: {e}"


def bench_decode(model_name: str = "llama-3.1-8b", *, batch: int = 1, input_len: int = 1, output_len: int = 128,
                 iters: int = 30, warmup: int = 3, impls: Sequence[str] = IMPLS, device=None,
                 dtype=torch.bfloat16, layers: Optional[int] = None, log=print, quant: Optional[str] = None,
                 quant_head: Optional[str] = None) -> list[dict]:
    """Run the decode benchmark; returns JSON-ready rows (one per implementation).

    ``quant_head`` ("fp8" / "int4") quantises the lm head too; the rows' ``shape.quant`` then reads
    ``<quant>+head-<quant_head>`` (``none+head-int4`` for the head alone). The peers keep a dense head.

    Under torch.distributed (torchrun) the model is tensor-parallel over the world (every rank runs;
    the caller reports rank 0's rows)."""
    import torch.distributed as dist

    from fastdecode.bench.harness import Timing, env_info
    from fastdecode.models.quantize import check_head

    check_head(quant_head, "quant_head")
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.engine.loader import load, random_model
    from fastdecode.models.config import PRESETS, ModelConfig
    from fastdecode.models.llama import Int4Linear

    tp = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    if device is None and tp is not None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 (one token from prefill, the rest from decode), got {output_len}")
    max_seq = input_len + output_len
    # the peer is built only when one of its rows will run; a failure to build it fails those rows only
    want_peer = tp is None and any(i == "peer-eager" or (i == "peer-compile" and device.type == "cuda")
                                   for i in impls)
    peer, peer_error = None, None
    if model_name.lower() in PRESETS or model_name.startswith("preset:"):
        cfg = ModelConfig.from_preset(model_name.split(":", 1)[-1])
        if layers:
            cfg = cfg.replace(n_layers=layers)
        model = random_model(cfg, device=device, dtype=dtype, max_seq_len=max_seq, tp=tp)
        if want_peer:  # from the dense weights, before fastdecode quantises (and frees) them
            peer, peer_error = _try_build_peer(model, quant, batch, max_seq)
        if quant is not None or quant_head is not None:
            from fastdecode.models.quantize import quantize_model

            quantize_model(model, quant, head=quant_head)
        if tp is not None:
            from fastdecode.engine.tp import attach_comm
            from fastdecode.ops.allreduce import CommWorkspace

            attach_comm(model, CommWorkspace())
    elif tp is not None:
        from fastdecode.engine.tp import load_tp

        loaded = load_tp(model_name, device=device, dtype=dtype, max_seq_len=max_seq, progress=False, quant=quant,
                         quant_head=quant_head)
        model, cfg = loaded.model, loaded.config
    else:
        loaded = load(model_name, device=device, dtype=dtype, max_seq_len=max_seq, progress=False, quant=quant,
                      quant_head=quant_head)
        model, cfg = loaded.model, loaded.config
        if want_peer:  # the format fastdecode runs (an int4 checkpoint is int4 without --quant)
            peer, peer_error = _try_build_peer(model, quant or model.quant, batch, max_seq)
    cache = KVCache(model.config, batch, max_seq, dtype=dtype, device=device)
    wbytes = model.decode_step_bytes(batch)  # weights one step reads (B embedding rows, not the table)
    has_int4 = any(isinstance(m, Int4Linear) for m in model.modules())
    # KV bytes read per step, averaged over the decode steps (positions input_len+1 .. max_seq-1)
    kv_avg = cache.bytes_read([batch * (input_len + output_len / 2)])
    peak = peak_bandwidth(device)
    shape = {"model": cfg.name + (f"[{layers} layers]" if layers else ""), "batch": batch, "input_len": input_len,
             "output_len": output_len, "dtype": str(dtype).replace("torch.", ""),
             "quant": (quant or "none") + (f"+head-{quant_head}" if quant_head else ""),
             "tp": tp[1] if tp else 1}
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    last_peer = max((i for i, impl in enumerate(impls) if impl in PEER_IMPLS), default=-1)
    for n, impl in enumerate(impls):
        skip = None
        if impl not in CPU_IMPLS and device.type != "cuda":
            skip = "needs CUDA"
        elif impl == "fastdecode-graph-no-fused_allreduce" and tp is None:
            skip = "needs --tp"
        elif impl == "fastdecode-graph-no-int4_gemm" and not has_int4:
            skip = "needs int4 weights (--quant int4)"
        elif impl in ("torch-compile",) + PEER_IMPLS and tp is not None:
            skip = "not with --tp"
        if skip:
            log(f"{impl}: skipped ({skip})")
            rows.append({"op": "decode", "impl": impl, "shape": shape, "skipped": skip, **env_info()})
            continue
        is_peer = impl in PEER_IMPLS
        try:
            if is_peer and peer is None:
                raise RuntimeError(f"the peer could not be built: {peer_error}")
            runner = _PeerRunner(impl, peer, batch) if is_peer else _Runner(impl, model, cache, batch)
            prompts = [torch.randint(0, cfg.vocab_size, (batch, input_len), device=device, generator=gen)
                       for _ in range(warmup + iters)]
            for p in prompts[:warmup]:
                runner.generate(p, output_len)
            pre, dec = zip(*(runner.generate(p, output_len) for p in prompts[warmup:]))
        except Exception as e:  # one failing implementation must not hide the others
            log(f"{impl}: failed: {type(e).__name__}: {e}")
            rows.append({"op": "decode", "impl": impl, "shape": shape, "error": f"{type(e).__name__}: {e}",
                         **env_info()})
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize()
            if n == last_peer:  # its last row: give its weights (FP8 / int4 copies) and cache back
                peer = None
        steps = output_len - 1
        step_us = sorted(d / steps * 1e6 for d in dec)
        total = [p + d for p, d in zip(pre, dec)]
        t = Timing(statistics.median(step_us), step_us[len(step_us) // 10],
                   step_us[min(len(step_us) - 1, (9 * len(step_us)) // 10)], len(step_us))
        # a peer reads its own tensors (per-tensor FP8 scales, tinygemm's scale + zero per group)
        wb = runner.model.decode_step_bytes(batch) if is_peer else wbytes
        step_bytes = wb + kv_avg
        row = {
            "op": "decode", "impl": impl, "shape": shape,
            "median_us": round(t.median_us, 2), "p10_us": round(t.p10_us, 2), "p90_us": round(t.p90_us, 2),
            "tokens_per_s": round(batch * output_len / statistics.median(total), 2),
            "decode_tokens_per_s": round(batch * 1e6 / t.median_us, 2),
            "prefill_ms": round(statistics.median(pre) * 1e3, 3),
            "step_weight_bytes": wb, "bytes": int(step_bytes),
            "tbps": round(step_bytes / (t.median_us * 1e-6) / 1e12, 3),
        }
        if is_peer:
            row["peer"] = runner.model.description
        if peak:
            row["peak_tbps"] = peak / 1e12
            row["roofline_tokens_per_s"] = round(batch * peak / wb, 1)
            row["roofline_fraction"] = round(step_bytes / (t.median_us * 1e-6) / peak, 3)
        row.update(env_info())
        rows.append(row)
        log(f"{impl:>17}: {row['median_us']:9.1f} us/step  {row['tokens_per_s']:9.1f} tok/s  "
            f"{row['tbps']:.2f} TB/s" + (f"  ({row['roofline_fraction']:.0%} of peak)" if peak else ""))
        del runner
    model.backend = "auto"
    add_speedup_vs_peer(rows)
    for r in rows:
        if "speedup_vs_peer" in r:
            log(f"{r['impl']:>17}: {r['speedup_vs_peer']:.2f}x the compiled peer (peer-compile)")
    return rows


def plot_rows(rows: list[dict], path: str) -> None:
    """Bar chart of tokens/s per implementation (and the weight-bytes roofline), PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["impl"] for r in ok]
    vals = [r["tokens_per_s"] for r in ok]
    ax.barh(names, vals, color=["#999" if not n.startswith("fastdecode") else "#d62" for n in names])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}", va="center")
    roof = next((r.get("roofline_tokens_per_s") for r in ok if r.get("roofline_tokens_per_s")), None)
    if roof:
        ax.axvline(roof, ls="--", color="k", lw=1)
        ax.text(roof, -0.45, "weight-bytes roofline ", va="bottom", ha="right", fontsize=8)
    s = ok[0]["shape"] if ok else {}
    ax.set_xlabel("tokens/s")
    ax.set_title(f"decode {s.get('model', '')} batch {s.get('batch', '')} "
                 f"in {s.get('input_len', '')} out {s.get('output_len', '')} ({ok[0]['gpu'] if ok else ''})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", "--model", dest="model", default="llama-3.1-8b",
                   help="a preset (random weights: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, smollm2-135m, "
                        "tiny) or a checkpoint path")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (several: one run each)")
    p.add_argument("--input-len", type=int, default=1)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS + EXTRA_IMPLS + ABLATIONS)
    p.add_argument("--ablate", action="store_true",
                   help="add fastdecode-graph with each kernel switched off in turn, and fastdecode-eager")
    p.add_argument("--quant", default=None, choices=list(METHODS),
                   help="quantise the model: fp8 (W8A8) or int4 (W4A16, RTN group 128)")
    p.add_argument("--quant-head", default=None, choices=list(METHODS),
                   help="quantise the lm head too: fp8 (W8A8) or int4 (W4A16, RTN group 128)")
    p.add_argument("--tp", type=int, default=None, help="tensor parallelism over N GPUs (relaunches under torchrun)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (big presets)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None,
                   help="JSON result file (default: benchmarks/results/decode.json on CUDA, no file on a CPU); "
                        "measured rows are merged into an existing one: a row with the same model, impl "
                        "(ablations included), dtype, quant, tp, batch, input/output length and GPU is replaced, "
                        "the others are kept; skipped or failed rows are printed, never written; '' writes "
                        "nothing")
    p.add_argument("--plot", default=None, nargs="?", const="", help="write a PNG (default: next to --out)")


def row_key(row: dict) -> tuple:
    """What one decode row measures: rows with equal keys replace each other in a results file.
    (Older rows have no quant / tp in their shape: none and 1.)"""
    s = row.get("shape", {})
    return (row.get("op"), s.get("model"), row.get("impl"), s.get("dtype"), s.get("quant") or "none",
            s.get("tp") or 1, s.get("batch"), s.get("input_len"), s.get("output_len"), row.get("gpu"))


def merge_rows(old: list, new: list[dict]) -> list[dict]:
    """``old`` with each row of ``new`` in place of the old row of the same ``row_key`` (new keys appended),
    except that a row without a measurement (skipped, failed) does not replace one with."""
    from fastdecode.bench.harness import merged_rows

    return merged_rows(old, new, key=row_key, keep_measured=True)


DEFAULT_OUT = "benchmarks/results/decode.json"


def is_measured(row: dict) -> bool:
    """A row a results file may hold: it has a measurement (``tokens_per_s``) and no ``error``."""
    return "error" not in row and bool(row.get("tokens_per_s"))


def results_path(args) -> Optional[str]:
    """Where ``run`` writes: ``--out`` when given ('' is no file); otherwise ``DEFAULT_OUT`` on CUDA and
    nothing on a CPU (a CPU run must not land in the committed GPU results)."""
    if args.out is not None:
        return args.out or None
    dev = getattr(args, "device", None)
    cuda = torch.device(dev).type == "cuda" if dev else torch.cuda.is_available()
    return DEFAULT_OUT if cuda else None


def run(args) -> int:
    import torch.distributed as dist

    from fastdecode.bench.harness import merge_rows as harness_merge, print_table
    from fastdecode.engine.cli import _finish_tp, _maybe_relaunch, _under_torchrun

    code = _maybe_relaunch(args)  # --tp N outside torchrun: the same command under torchrun
    if code is not None:
        return code
    if _under_torchrun():
        from fastdecode.engine.tp import init_distributed

        init_distributed(getattr(args, "device", None))
    main = not dist.is_initialized() or dist.get_rank() == 0
    impls = list(args.impl) + ([a for a in ABLATIONS if a not in args.impl] if getattr(args, "ablate", False) else [])
    rows = []
    for b in args.batch:
        rows += bench_decode(args.model, batch=b, input_len=args.input_len, output_len=args.output_len,
                             iters=args.iters, warmup=args.warmup, impls=impls, device=args.device,
                             dtype=getattr(torch, args.dtype), layers=args.layers, quant=getattr(args, "quant", None),
                             quant_head=getattr(args, "quant_head", None),
                             log=(lambda m: print(m, file=sys.stderr, flush=True)) if main else (lambda m: None))
    _finish_tp()
    if not main:
        return 0
    print_table(rows, ("impl", "shape", "median_us", "tokens_per_s", "tbps", "roofline_tokens_per_s"))
    out = results_path(args)
    measured = [r for r in rows if is_measured(r)]
    if out and measured:
        merged = harness_merge(measured, out, key=row_key, keep_measured=True)
        print(f"wrote {out} ({len(measured)} measured rows of {len(rows)}, {len(merged)} in the file)",
              file=sys.stderr)
    elif out:
        print(f"no measured rows: nothing written to {out}", file=sys.stderr)
    elif args.out is None:
        print("a CPU run writes no results file unless --out names one", file=sys.stderr)
    if args.plot is not None:
        path = args.plot or (out.rsplit(".", 1)[0] + ".png" if out else "decode.png")
        for b in args.batch:
            sub = [r for r in rows if r["shape"]["batch"] == b]
            plot_rows(sub, path if len(args.batch) == 1 else path.replace(".png", f".b{b}.png"))
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fastdecode bench decode", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
