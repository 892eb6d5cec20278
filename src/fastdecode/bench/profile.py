"""Where the time of a decode step goes: kernel time and bytes per kernel family against the copy-rate floor.

``fastdecode bench decode --profile`` replays the captured decode step (the rows of ``bench decode``'s
``DecodeRunner``) under ``torch.profiler``, takes every GPU kernel of each step in start order and attributes it
to a family:

* the GEMMs, by position: a Llama block runs four (qkv, o, gate_up, down: the SiLU-and-mul may live inside
  down's kernel), so the GEMM kernels of a step are ``[qkv, o, gate_up, down] x n_layers`` and then the
  ``head``; a step whose GEMM count is not ``4 n_layers + 1`` (a cuBLAS split-K reduction kernel, say) leaves
  them ``gemm`` (not attributed) rather than guess;
* the rest by kernel name: ``attention`` (RoPE + KV write and the decode attention), ``norms``
  (add + RMSNorm, with or without FP8 output), ``activation`` (SiLU-and-mul, FP8 quantisation),
  ``allreduce`` (TP), ``sampling`` (argmax), ``other`` (embedding lookup, copies).

Each family's floor is the bytes it must move over the device-to-device copy rate of the GPU it ran on, measured
in the same process (``copy_bandwidth``; 4.24 TB/s on the H200, ``COPY_BW``, the default where none is given): the
weights for the GEMMs (``Int4Linear``: packed nibbles + scales), the live KV cache for attention, the activations
for the rest. Each record names the rate (``copy_tbps``). Until session 45 every card's floor used the H200's rate,
so an H100's ``x_floor`` read high by that card's shortfall. ``gaps`` is the step's span (first kernel start to
last kernel end) minus the kernels' summed durations: time in which no kernel of the step ran.

With programmatic dependent launch (the default graph) each kernel starts before its predecessor ends and
waits inside, so durations overlap and do not attribute time (the sum exceeds the span; ``gaps`` < 0). Profile
``fastdecode-graph-no-pdl`` (the default of ``--profile``) for the attribution; its span is PDL's gain away
from the real step.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Optional, Sequence

import torch

COPY_BW = 4.24e12  # bytes/s: device-to-device copy measured on the H200 (docs/benchmarking.md)
GEMM_ORDER = ("qkv", "o", "gate_up", "down")
FAMILIES = GEMM_ORDER + ("head", "gemm", "attention", "norms", "activation", "allreduce", "sampling", "other")
# kernel-name patterns, first match wins (the GEMM test runs first: the fused SiLU-and-mul + down GEMM is a GEMM)
_GEMM = re.compile(r"linear|gemm|gemv|_mma_|int4_a8|nvjet|cutlass|xmma|scaled_mm|int4pack|tinygemm", re.I)
_NAMED = (("other", re.compile(r"dequant", re.I)),  # the int4 fallback's weight dequantisation, not an activation
          ("allreduce", re.compile(r"all_?reduce|nccl", re.I)),
          ("attention", re.compile(r"attention|rope|kv_write|flash|sdpa", re.I)),
          ("norms", re.compile(r"norm", re.I)),
          ("activation", re.compile(r"silu|swiglu|quant", re.I)),
          ("sampling", re.compile(r"argmax|sampl|topk|softmax", re.I)))


def kernel_class(name: str) -> str:
    """``gemm`` or one of the named families (``other`` when nothing matches)."""
    if _GEMM.search(name):
        return "gemm"
    for fam, pat in _NAMED:
        if pat.search(name):
            return fam
    return "other"


def attribute(names: Sequence[str], n_layers: int) -> list[str]:
    """The family of each kernel of one step, given in start order (module docstring)."""
    cls = [kernel_class(n) for n in names]
    n_gemm = cls.count("gemm")
    if n_gemm != 4 * n_layers + 1:
        return cls
    labels = [GEMM_ORDER[i % 4] for i in range(4 * n_layers)] + ["head"]
    it = iter(labels)
    return [next(it) if c == "gemm" else c for c in cls]


def _module_bytes(m) -> int:
    """Bytes one forward of ``m`` reads from its weights (``Int4Linear``: its packed bytes, as
    ``Transformer.weight_bytes`` counts them)."""
    from fastdecode.models.int4 import Int4Linear
    from fastdecode.models.llama import unique_param_bytes

    return m.weight_bytes() if isinstance(m, Int4Linear) else unique_param_bytes(m.parameters())


def family_bytes(model, batch: int, kv_bytes: int) -> dict[str, int]:
    """Bytes one decode step of ``batch`` rows must move, per family: weights (GEMMs), the live KV cache
    (attention: ``kv_bytes``) and the activations of the small kernels (read + written, the model's dtype)."""
    L, H = len(model.layers), model.config.dim
    a = batch * model.layers[0].attention_norm.weight.element_size()  # bytes of one activation value, all rows
    fam = defaultdict(int)
    for blk in model.layers:
        fam["qkv"] += _module_bytes(blk.attention.wqkv)
        fam["o"] += _module_bytes(blk.attention.wo)
        fam["gate_up"] += _module_bytes(blk.feed_forward.w13)
        fam["down"] += _module_bytes(blk.feed_forward.w2)
        fam["norms"] += _module_bytes(blk.attention_norm) + _module_bytes(blk.ffn_norm)
    fam["head"] = _module_bytes(model.output)
    # this rank's widths (tensor parallel: the shards)
    qkv_out, q_size = blk.attention.wqkv.out_features, blk.attention.wo.in_features
    inter = blk.feed_forward.w2.in_features
    # add + RMSNorm: x and residual in, residual and the normed row out, twice a block (+ the final norm)
    fam["norms"] += (2 * L + 1) * 4 * H * a + _module_bytes(model.norm)
    # RoPE + KV write inside the attention kernel (fused_rope): qkv in, the new K / V, the cache, the output row
    # out; apart, q also goes out and back in
    q_trip = 0 if blk.attention.fused_rope else 2 * q_size
    fam["attention"] = kv_bytes + L * (qkv_out + (qkv_out - q_size) + q_size + q_trip) * a
    # SiLU-and-mul: gate and up in, the product out (inside down's kernel when fused: counted there too)
    fam["activation"] = L * 3 * inter * a
    fam["sampling"] = model.output.out_features * a  # the logits, read once
    return dict(fam)


def copy_bandwidth(device=None, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes a second of a device-to-device copy of ``nbytes`` on a CUDA ``device``, counted read plus written (as
    the H200's 4.24 TB/s: 8 GiB moved in 2026.9 us, docs/benchmarking.md): the median of ``reps`` eager copies
    timed after one untimed (``bench.harness.time_cuda``)."""
    from fastdecode.bench.harness import time_cuda

    if nbytes < 1 or reps < 1:
        raise ValueError(f"nbytes and reps must be >= 1, got {nbytes}, {reps}")
    dev = torch.device(device or "cuda")
    if dev.type != "cuda":
        raise ValueError(f"copy_bandwidth measures a CUDA device, got {dev}")
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = time_cuda([lambda: dst.copy_(src)], graph=False, warmup=1, reps=reps).median_us
    return 2 * nbytes / (us * 1e-6)


def family_table(steps: Sequence[Sequence[tuple[str, float, float]]], n_layers: int,
                 bytes_by_family: Optional[dict] = None, copy_bw: float = COPY_BW) -> dict:
    """``steps``: per step, its kernels as (name, start us, duration us). Returns the span, kernel time and
    kernel count per step (means over the steps) and one row per family present, in ``FAMILIES`` order,
    then ``gaps``; each family's floor is its bytes over ``copy_bw`` (bytes/s)."""
    if not steps or not steps[0]:
        raise ValueError("no kernels were recorded")
    if not copy_bw > 0:
        raise ValueError(f"copy_bw must be > 0 bytes/s, got {copy_bw}")
    n = len(steps)
    us, calls = defaultdict(float), defaultdict(float)
    span = 0.0
    for kern in steps:
        kern = sorted(kern, key=lambda k: k[1])
        for fam, (_, _, dur) in zip(attribute([k[0] for k in kern], n_layers), kern):
            us[fam] += dur / n
            calls[fam] += 1 / n
        span += (max(s + d for _, s, d in kern) - kern[0][1]) / n
    ksum = sum(us.values())
    bytes_by_family = bytes_by_family or {}
    rows = []
    for fam in FAMILIES:
        if fam not in us:
            continue
        row = {"family": fam, "calls_per_step": round(calls[fam], 2), "us_per_step": round(us[fam], 2),
               "share": round(us[fam] / span, 4) if span else None}
        b = bytes_by_family.get(fam)
        if b:
            floor = b / copy_bw * 1e6
            row.update(bytes_per_step=int(b), floor_us=round(floor, 2), x_floor=round(us[fam] / floor, 2))
        rows.append(row)
    rows.append({"family": "gaps", "calls_per_step": None, "us_per_step": round(span - ksum, 2),
                 "share": round((span - ksum) / span, 4) if span else None})
    return {"span_us_per_step": round(span, 2), "kernel_us_per_step": round(ksum, 2),
            "kernels_per_step": round(sum(len(k) for k in steps) / n, 2), "copy_tbps": round(copy_bw / 1e12, 3),
            "families": rows}


def format_table(rec: dict) -> str:
    """The family table as text (what ``bench decode --profile`` prints)."""
    sh = rec.get("shape", {})
    pdl = "" if rec.get("pdl", True) or rec.get("impl") == "fastdecode-graph-no-pdl" else " (PDL off)"
    head = (f"{sh.get('model', '?')} quant={sh.get('quant')} {rec.get('impl')}{pdl} batch={sh.get('batch')}: "
            f"span {rec['span_us_per_step']:.1f} us/step, kernels {rec['kernel_us_per_step']:.1f} us "
            f"({rec['kernels_per_step']:.0f} kernels)"
            + (f", floors at a copy rate of {rec['copy_tbps']:.2f} TB/s" if "copy_tbps" in rec else ""))
    lines = [head, f"{'family':<11}{'calls':>7}{'us/step':>10}{'share':>8}{'MB/step':>10}{'floor us':>10}"
                   f"{'x floor':>9}"]
    for r in rec["families"]:
        calls = "" if r["calls_per_step"] is None else f"{r['calls_per_step']:.0f}"
        share = "" if r["share"] is None else f"{r['share']:.1%}"
        mb = f"{r['bytes_per_step'] / 1e6:.1f}" if "bytes_per_step" in r else ""
        floor = f"{r['floor_us']:.1f}" if "floor_us" in r else ""
        x = f"{r['x_floor']:.2f}" if "x_floor" in r else ""
        lines.append(f"{r['family']:<11}{calls:>7}{r['us_per_step']:>10.1f}{share:>8}{mb:>10}{floor:>10}{x:>9}")
    if rec["kernel_us_per_step"] > rec["span_us_per_step"]:
        lines.append("(kernels overlap: programmatic dependent launch; profile fastdecode-graph-no-pdl to attribute)")
    return "\n".join(lines)


def record_steps(runner, tokens: torch.Tensor, pos: torch.Tensor, steps: int) -> list[list[tuple]]:
    """Replay ``runner.step`` ``steps`` times under ``torch.profiler`` (CUDA); each step's kernels as
    (name, start us, duration us), in start order. Split by count: every step launches the same kernels."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.step(tokens, pos)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step(tokens, pos)
        torch.cuda.synchronize()
    kern = sorted(((e.name, e.time_range.start, e.device_time) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[1])
    if not kern or len(kern) % steps:
        raise RuntimeError(f"{len(kern)} kernels recorded over {steps} steps: not the same kernels each step")
    per = len(kern) // steps
    return [kern[i * per:(i + 1) * per] for i in range(steps)]


def kernel_rows(steps: Sequence[Sequence[tuple]]) -> list[dict]:
    """Per kernel name: calls and us per step, the largest first."""
    us, calls = defaultdict(float), defaultdict(float)
    for kern in steps:
        for name, _, dur in kern:
            us[name] += dur / len(steps)
            calls[name] += 1 / len(steps)
    return [{"name": k, "calls_per_step": round(calls[k], 2), "us_per_step": round(v, 2)}
            for k, v in sorted(us.items(), key=lambda kv: -kv[1])]


def profile_decode(model_name: str = "llama-3.1-8b", *, impls: Sequence[str] = ("fastdecode-graph-no-pdl",),
                   batch: int = 1, input_len: int = 1, output_len: int = 128, steps: int = 20, device=None,
                   dtype=torch.bfloat16, layers: Optional[int] = None, quant: Optional[str] = None,
                   quant_head: Optional[str] = None, gguf_native: Optional[bool] = None, log=print) -> list[dict]:
    """Profile the decode step of each of ``impls`` (``bench decode``'s rows, not the peers) at the mean position
    of the timed benchmark (``input_len + output_len // 2``); one record per impl with the family table
    (``family_table``), the per-kernel rows and the environment. Needs CUDA. ``gguf_native``: as ``bench_decode``'s."""
    from fastdecode.bench.decode import PEER_IMPLS, DecodeRunner, build_bench_model, model_label, quant_label
    from fastdecode.bench.harness import env_info
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.ops import pdl_enabled

    peers = [i for i in impls if i in PEER_IMPLS]
    if peers:
        raise ValueError(f"--profile runs fastdecode's own rows; the peers ({', '.join(peers)}) are not profiled")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if torch.device(device or "cuda").type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"--profile needs a CUDA device (it records the decode step's GPU kernels); device "
                           f"{device!r}, CUDA available: {torch.cuda.is_available()}")
    max_seq = input_len + output_len
    position = input_len + output_len // 2
    built = build_bench_model(model_name, batch=batch, max_seq=max_seq, device=device, dtype=dtype, layers=layers,
                              quant=quant, quant_head=quant_head, gguf_native=gguf_native)
    model = built.model
    cache = KVCache(model.config, batch, max_seq, dtype=dtype, device=built.device)
    fam_bytes = family_bytes(model, batch, cache.bytes_read([batch * (position + 1)]))
    tok = torch.zeros(batch, dtype=torch.long, device=built.device)
    pos = torch.full((batch,), position, dtype=torch.long, device=built.device)
    shape = {"model": model_label(built.config, layers), "batch": batch, "position": position,
             "dtype": str(dtype).replace("torch.", ""), "quant": quant_label(quant, quant_head, gguf_native is False),
             "tp": built.tp[1] if built.tp else 1}
    copy_bw = copy_bandwidth(built.device)  # this card's floor (module docstring)
    recs = []
    for impl in impls:
        runner = DecodeRunner(impl, model, cache, batch)
        per_step = record_steps(runner, tok, pos, steps)
        del runner
        # PDL as captured: off for the -no-pdl row, and for every row when FASTDECODE_PDL=0 (or set_pdl(False))
        # turns it off for the process (how a row with another switch is profiled without PDL)
        rec = {"op": "decode_profile", "impl": impl, "shape": shape, "steps": steps,
               "pdl": impl != "fastdecode-graph-no-pdl" and pdl_enabled(tok),
               **family_table(per_step, len(model.layers), fam_bytes, copy_bw), "kernels": kernel_rows(per_step),
               **env_info()}
        log(format_table(rec))
        recs.append(rec)
    model.backend = "auto"
    return recs


__all__ = ["COPY_BW", "FAMILIES", "attribute", "copy_bandwidth", "family_bytes", "family_table", "format_table",
           "kernel_class", "kernel_rows", "profile_decode", "record_steps"]
