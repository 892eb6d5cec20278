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
per-tensor FP8 scales, tinygemm's bf16 scale + zero per group). The peer prefills eagerly, like ``torch-compile``;
rows that replay a graph prefill a one-token prompt with it (a decode step at position 0, as ``Engine.prefill``).

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
cuBLAS; int4 models only), ``-no-pdl`` (the graph captured without programmatic dependent launch,
``fastdecode.kernels.pdl``), ``-no-argmax`` (the next tokens from ``torch.argmax`` rather than
``fastdecode.argmax``), ``-no-norm_gemm`` (the RMSNorms and residual adds as kernels of their own rather than
inside the bf16 / int4 GEMMs, ``models.norm_gemm``), ``-no-fp8_a16`` (FP8 wqkv, wo and w2 W8A8 at decode, their
activations quantised; fp8 models only) and ``fastdecode-eager`` (no CUDA graph);
``fastdecode-graph-with-<switch>`` turns on a switch that is off by default (``OPT_IN_KERNELS``: ``int4_a8``,
``fp8_a16_all``, ``l2_prefetch``; and ``weight_prefetch``, the GEMVs' L2 prefetch of their weight slabs in every
GEMV that can, a launch policy captured into the graph as PDL is: ``fastdecode.ops.set_weight_prefetch``; by
default only small bf16 / fp16 weights at one token take it, ``-no-weight_prefetch`` none), ``-with-<a>+<b>``
several (``-with-int4_a8+l2_prefetch``).
The fastdecode rows take the next tokens with
``fastdecode.argmax`` (after the graph, as ``Engine``'s greedy sampler does), the torch rows with ``torch.argmax``.

``--quant fp8`` quantises the random-weight model (W8A8), ``--quant int4`` to W4A16 (RTN, group 128; a
checkpoint path loads as stored when it is int4 already: GPTQ, AWQ, GGUF Q4_0 / Q4_1); ``--tp N`` runs under
torchrun with N ranks (rank 0 reports; ``step_weight_bytes`` are per rank, the packed int4 bytes for int4).

On a CPU only ``torch-eager`` and ``peer-eager`` run (wall-clock timing); the others are reported as skipped;
under ``--tp`` the peers are skipped (single-device models).

Before anything is allocated for the run, the KV cache is checked against the device's available memory
(``engine.kv_cache.check_kv_memory``): too large a ``batch`` x (``input_len`` + ``output_len``) raises
``KVCacheMemoryError`` (one ``error:`` line from ``fastdecode bench decode``), not a CUDA out-of-memory error.

This module measures (``bench_decode``, the runners ``DecodeRunner`` / ``PeerDecodeRunner``, which
``benchmarks/profile_decode.py`` reuses); ``fastdecode.bench.decode_results`` holds what happens to the rows
afterwards (results file, merge, plot); ``fastdecode.cli.bench`` the ``fastdecode bench decode`` command. Unlike
the kernel benchmarks this one measures the engine, so it imports ``fastdecode.engine`` (inside functions).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import NamedTuple, Optional, Sequence

import torch

from fastdecode.bench.decode_results import add_speedup_vs_peer
from fastdecode.models import norm_gemm
from fastdecode.models.llama import KERNELS, OPT_IN_KERNELS, Fp8Linear
from fastdecode.ops import argmax as fd_argmax, pdl_override, weight_prefetch_override

IMPLS = ("torch-eager", "torch-graph", "torch-compile", "peer-compile", "fastdecode-graph-cublas", "fastdecode-graph")
# not in the default list: every GEMM through the skinny Triton kernels (the table's best Triton config), and
# the peer uncompiled (slow on a GPU; what runs on a CPU)
EXTRA_IMPLS = ("fastdecode-graph-triton", "peer-eager")
PEER_IMPLS = ("peer-compile", "peer-eager")
CPU_IMPLS = ("torch-eager", "peer-eager")
# launch policies (captured into the graph, as PDL is): the GEMVs' weight-slab L2 prefetch; -with- every GEMV that
# can, -no- none, neither the default rule (ops.weight_prefetch_enabled)
OPT_IN_POLICIES = ("weight_prefetch",)
ABLATIONS = (("fastdecode-eager",) + tuple(f"fastdecode-graph-no-{k}" for k in KERNELS if k not in OPT_IN_KERNELS)
             + ("fastdecode-graph-no-pdl", "fastdecode-graph-no-argmax", "fastdecode-graph-no-weight_prefetch")
             + tuple(f"fastdecode-graph-with-{k}" for k in OPT_IN_KERNELS + OPT_IN_POLICIES))


def check_impl(impl: str) -> str:
    """``impl`` if ``bench_decode`` knows the row: ``IMPLS``, ``EXTRA_IMPLS``, ``ABLATIONS``, or
    ``fastdecode-graph-with-<a>+<b>...`` over ``OPT_IN_KERNELS`` and ``OPT_IN_POLICIES``; else ValueError."""
    if impl in IMPLS + EXTRA_IMPLS + ABLATIONS + PEER_IMPLS:
        return impl
    prefix = "fastdecode-graph-with-"
    ks = impl[len(prefix):].split("+") if impl.startswith(prefix) else []
    if ks and len(set(ks)) == len(ks) and all(k in OPT_IN_KERNELS + OPT_IN_POLICIES for k in ks):
        return impl
    raise ValueError(f"unknown decode row {impl!r}: one of {', '.join(IMPLS + EXTRA_IMPLS + ABLATIONS)}, or "
                     f"{prefix}<a>+<b> over {', '.join(OPT_IN_KERNELS + OPT_IN_POLICIES)}")


# what to lower when the KV cache would not fit (the hint of check_kv_memory's message)
KV_FIX = "lower --batch, --input-len or --output-len"
# Peak HBM bandwidth by GPU name fragment, bytes/s (vendor figures); the copy anchor is 4.24 TB/s on H200
PEAK_BW = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
           "A100": 2.0e12}


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


def peak_bandwidth(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for k, v in PEAK_BW.items():
        if k in name:
            return v
    return None


class DecodeRunner:
    """One implementation: prefill and a decode step that returns the next tokens (greedy, on device)."""

    def __init__(self, impl: str, model, cache, batch: int):
        self.impl, self.model, self.cache, self.batch = impl, model, cache, batch
        self.graphs = None
        self.compiled = None
        dev = cache.device
        # the defaults (opt-in switches off); also resets the GEMM impl (skinny_gemm on)
        model.set_kernels(**{k: k not in OPT_IN_KERNELS for k in KERNELS})
        pdl_off = impl == "fastdecode-graph-no-pdl"  # the graph captured without programmatic dependent launch
        # the GEMVs' weight-slab L2 prefetch in the graph (a launch policy, like PDL): None the default rule
        slabs = False if impl == "fastdecode-graph-no-weight_prefetch" else None
        # the next tokens: fastdecode.argmax on the fastdecode rows, torch.argmax on the torch rows and the ablation
        self.argmax = (fd_argmax if impl.startswith("fastdecode") and impl != "fastdecode-graph-no-argmax"
                       else _torch_argmax)
        if pdl_off or impl in ("fastdecode-graph-no-argmax", "fastdecode-graph-no-weight_prefetch"):
            model.backend = "triton"
        elif impl.startswith("fastdecode-graph-no-"):
            k = impl[len("fastdecode-graph-no-"):]
            if k not in KERNELS or k in OPT_IN_KERNELS:
                raise ValueError(f"unknown ablation {impl!r}")
            model.backend = "triton"
            model.set_kernels(**{k: False})
        elif impl.startswith("fastdecode-graph-with-"):  # opt-in switches on ("+" between several)
            ks = impl[len("fastdecode-graph-with-"):].split("+")
            if "weight_prefetch" in ks:
                slabs = True
            ks = [k for k in ks if k not in OPT_IN_POLICIES]
            bad = [k for k in ks if k not in OPT_IN_KERNELS]
            if bad:
                raise ValueError(f"unknown opt-in kernel switch {bad[0]!r} in {impl!r}; "
                                 f"known: {', '.join(OPT_IN_KERNELS + OPT_IN_POLICIES)}")
            model.backend = "triton"
            model.set_kernels(**{k: True for k in ks})
        elif impl == "fastdecode-eager":
            model.backend = "triton"
        elif impl in ("torch-eager", "torch-graph"):
            model.backend = "torch"
        elif impl == "torch-compile":
            model.backend = "ref"
            # the cache is mutated in place: give it a static address, as a module buffer would have,
            # so that cudagraph trees keep (rather than skip) the graph
            torch._dynamo.reset()  # a clean cache for this model's decode (see PeerDecodeRunner)
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
            self.compiled = torch.compile(model.decode, mode="reduce-overhead", fullgraph=True)
        elif impl in ("fastdecode-graph", "fastdecode-graph-cublas", "fastdecode-graph-triton"):
            model.backend = "triton"
            # ablation: every fastdecode kernel, with the GEMMs on cuBLAS or through the dispatcher
            model.set_gemm_impl("cublas" if impl.endswith("-cublas")
                                else ("triton" if impl.endswith("-triton") else None))
        else:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if impl == "torch-graph" or impl.startswith("fastdecode-graph"):  # every *-graph* row replays a graph
            if dev.type != "cuda":
                raise RuntimeError(f"{impl} needs a CUDA device")
            from fastdecode.engine.cuda_graph import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(model, cache, buckets=[batch])
            with pdl_override(False) if pdl_off else contextlib.nullcontext(), weight_prefetch_override(slabs):
                self.graphs.capture()

    def step(self, tokens, pos):
        if self.graphs is not None:
            logits = self.graphs.run(tokens, pos)
        elif self.compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
            logits = self.compiled(tokens, pos, self.cache)
        else:
            logits = self.model.decode(tokens, pos, self.cache)
        return self.argmax(logits)

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [B, S] -> the first new tokens [B] (greedy, on device)."""
        B, S = prompt.shape
        if S == 1 and self.graphs is not None:  # a decode step at position 0, as Engine.prefill does
            return self.step(prompt[:, 0], torch.zeros(B, dtype=torch.long, device=prompt.device))
        logits = self.model.prefill(prompt, self.cache, last_idx=torch.full((B,), S - 1, device=prompt.device))
        return self.argmax(logits)

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


class PeerDecodeRunner(DecodeRunner):
    """The peer (``fastdecode.bench.peers.PeerLlama``): eager prefill; its greedy decode step eager
    (``peer-eager``) or under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (``peer-compile``).
    The generate loop and its timing are ``DecodeRunner``'s."""

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


def _try_build_peer(model, quant, batch: int, max_seq: int, quant_head=None):
    """``(peer, None)`` or ``(None, "Type: message")``."""
    from fastdecode.bench.peers import build_peer

    try:
        return build_peer(model, quant, batch, max_seq, quant_head=quant_head), None
    except Exception as e:  # reported on the peer's rows; the other rows still run
        return None, f"{type(e).__name__}: {e}"


def model_label(cfg, layers: Optional[int]) -> str:
    """A row's ``shape.model``: the config's name, ``[N layers]`` when cut to ``layers``."""
    return cfg.name + (f"[{layers} layers]" if layers else "")


def quant_label(quant: Optional[str], quant_head: Optional[str], dequantized: bool = False) -> str:
    """A row's ``shape.quant``: ``none`` / ``fp8`` / ``int4``, ``+head-<q>`` when the lm head is quantised too;
    ``dequantized``: a GGUF's int4 weights loaded dense (``--dequantize``)."""
    return ("dequantized" if dequantized else quant or "none") + (f"+head-{quant_head}" if quant_head else "")


class BenchModel(NamedTuple):
    model: object
    config: object
    device: torch.device
    tp: Optional[tuple]  # (rank, world size) under torch.distributed
    peer: object = None
    peer_error: Optional[str] = None


def build_bench_model(model_name: str, *, batch: int, max_seq: int, device=None, dtype=torch.bfloat16,
                      layers: Optional[int] = None, quant: Optional[str] = None, quant_head: Optional[str] = None,
                      impls: Sequence[str] = (), gguf_native: Optional[bool] = None) -> BenchModel:
    """The model a decode benchmark runs: a preset with random weights (quantised as asked) or a checkpoint,
    tensor-parallel under torch.distributed; the KV cache checked against free memory (``KVCacheMemoryError``);
    the compiled peer built too when one of ``impls`` is a peer row (its failure is kept in ``peer_error``).
    ``gguf_native``: as ``loader.load``'s (a checkpoint only)."""
    import torch.distributed as dist

    from fastdecode.models.quantize import check_head

    check_head(quant_head, "quant_head")
    from fastdecode.engine.kv_cache import check_kv_memory
    from fastdecode.engine.loader import load, random_model
    from fastdecode.models.config import PRESETS, ModelConfig

    tp = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    kv_group = dist.group.WORLD if tp is not None else None  # the KV-memory check agreed by every rank
    if device is None and tp is not None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # the peer is built only when one of its rows will run; a failure to build it fails those rows only
    want_peer = tp is None and any(i == "peer-eager" or (i == "peer-compile" and device.type == "cuda")
                                   for i in impls)
    peer, peer_error = None, None
    if model_name.lower() in PRESETS or model_name.startswith("preset:"):
        cfg = ModelConfig.from_preset(model_name.split(":", 1)[-1])
        if layers:
            cfg = cfg.replace(n_layers=layers)
        model = random_model(cfg, device=device, dtype=dtype, max_seq_len=max_seq, tp=tp)
        # before the peer's cache and ours
        check_kv_memory(model.config, batch, max_seq, dtype, device, fix=KV_FIX, group=kv_group)
        if want_peer:  # from the dense weights, before fastdecode quantises (and frees) them
            peer, peer_error = _try_build_peer(model, quant, batch, max_seq, quant_head)
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
                         quant_head=quant_head, gguf_native=gguf_native)
        model, cfg = loaded.model, loaded.config
        check_kv_memory(model.config, batch, max_seq, dtype, device, fix=KV_FIX, group=kv_group)
    else:
        loaded = load(model_name, device=device, dtype=dtype, max_seq_len=max_seq, progress=False, quant=quant,
                      quant_head=quant_head, gguf_native=gguf_native)
        model, cfg = loaded.model, loaded.config
        check_kv_memory(model.config, batch, max_seq, dtype, device, fix=KV_FIX)
        if want_peer:  # the format fastdecode runs (an int4 checkpoint is int4 without --quant)
            peer, peer_error = _try_build_peer(model, quant or model.quant, batch, max_seq, quant_head)
    return BenchModel(model, cfg, device, tp, peer, peer_error)


def bench_decode(model_name: str = "llama-3.1-8b", *, batch: int = 1, input_len: int = 1, output_len: int = 128,
                 iters: int = 30, warmup: int = 3, impls: Sequence[str] = IMPLS, device=None,
                 dtype=torch.bfloat16, layers: Optional[int] = None, log=print, quant: Optional[str] = None,
                 quant_head: Optional[str] = None, gguf_native: Optional[bool] = None) -> list[dict]:
    """Run the decode benchmark; returns JSON-ready rows (one per implementation).

    ``quant_head`` ("fp8" / "int4") quantises the lm head too; the rows' ``shape.quant`` then reads
    ``<quant>+head-<quant_head>`` (``none+head-int4`` for the head alone). The peers quantise their head the same
    way (``bench.peers.build_peer``'s ``quant_head``; their rows' ``peer`` names it). ``gguf_native=False``: a GGUF's
    int4 weights loaded dense (``--dequantize``; ``shape.quant`` reads ``dequantized``).

    Under torch.distributed (torchrun) the model is tensor-parallel over the world (every rank runs;
    the caller reports rank 0's rows)."""
    from fastdecode.bench.harness import Timing, env_info
    from fastdecode.engine.cuda_graph import pdl_graphs_captured
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.models.int4 import Int4Linear

    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 (one token from prefill, the rest from decode), got {output_len}")
    max_seq = input_len + output_len
    built = build_bench_model(model_name, batch=batch, max_seq=max_seq, device=device, dtype=dtype, layers=layers,
                              quant=quant, quant_head=quant_head, impls=impls, gguf_native=gguf_native)
    model, cfg, device, tp = built.model, built.config, built.device, built.tp
    peer, peer_error = built.peer, built.peer_error
    cache = KVCache(model.config, batch, max_seq, dtype=dtype, device=device)
    wbytes = model.decode_step_bytes(batch)  # weights one step reads (B embedding rows, not the table)
    has_int4 = any(isinstance(m, Int4Linear) for m in model.modules())
    has_fp8 = any(isinstance(m, Fp8Linear) for m in model.modules())
    # KV bytes read per step, averaged over the decode steps (positions input_len+1 .. max_seq-1)
    kv_avg = cache.bytes_read([batch * (input_len + output_len / 2)])
    peak = peak_bandwidth(device)
    shape = {"model": model_label(cfg, layers), "batch": batch, "input_len": input_len,
             "output_len": output_len, "dtype": str(dtype).replace("torch.", ""),
             "quant": quant_label(quant, quant_head, gguf_native is False), "tp": tp[1] if tp else 1}
    norm_gemm_applies = norm_gemm.applies(model, batch)  # the default switches, as built
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
        elif impl in ("fastdecode-graph-no-fp8_a16", "fastdecode-graph-with-fp8_a16_all") and not has_fp8:
            skip = "needs fp8 weights (--quant fp8)"
        elif impl in ("torch-compile",) + PEER_IMPLS and tp is not None:
            skip = "not with --tp"
        elif impl == "fastdecode-graph-no-norm_gemm" and not norm_gemm_applies:
            skip = ("the default step has no norm_gemm here: bf16 / fp16, W4A16 on fma tiles at these rows (the "
                    "fused ops' own table entries where the table holds the shapes), or (fp8_a16, up to 4 rows) W8A16 "
                    "projections on one GPU (models.norm_gemm)")
        if skip:
            log(f"{impl}: skipped ({skip})")
            rows.append({"op": "decode", "impl": impl, "shape": shape, "skipped": skip, **env_info()})
            continue
        is_peer = impl in PEER_IMPLS
        try:
            if is_peer and peer is None:
                raise RuntimeError(f"the peer could not be built: {peer_error}")
            runner = PeerDecodeRunner(impl, peer, batch) if is_peer else DecodeRunner(impl, model, cache, batch)
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
        if runner.graphs is not None:  # from the second PDL graph of a process on, each runs slower (docs)
            row["pdl_graphs"] = pdl_graphs_captured()
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


__all__ = ["ABLATIONS", "BenchModel", "CPU_IMPLS", "DecodeRunner", "EXTRA_IMPLS", "IMPLS", "KV_FIX", "OPT_IN_POLICIES",
           "PEAK_BW", "PEER_IMPLS", "PeerDecodeRunner", "bench_decode", "build_bench_model", "check_impl",
           "model_label", "peak_bandwidth", "quant_label"]
