"""Accuracy of quantised formats, measured: ``fastdecode eval-accuracy [--model PATH] [--quant fp8 int4]``.

On a fixed English text that ships with the package (``fastdecode/data/accuracy_text.txt``, written for
this project), the unquantised model and each quantised one predict every next token (teacher forcing,
non-overlapping windows of ``window`` tokens, each window a fresh context). Reported per format:

* ``perplexity``: ``exp(mean NLL)`` of the text's tokens;
* ``top1_agreement``: the fraction of positions where the format's argmax equals the reference's;
* ``mean_kl``: mean ``KL(reference || format)`` of the next-token distributions, in nats.

The reference is the model in the load dtype (bf16 on GPUs, fp32 on the CPU) with ``quant=None`` (GGUF
files dequantised, also on CUDA, where their Q4_0 / Q4_1 tensors would otherwise load as int4). ``int4``
measures the RTN method (``int4-w4a16-g128-zero``) on the reference's weights, so for a GGUF source it
quantises the dequantised weights a second time; the GGUF's own Q4_0 / Q4_1 tensors loaded natively as
int4 weights are reported as one more row (``int4-w4a16-gguf``), which should match the reference up to
summation order: the same weights, through the int4 path.

The KV cache of one window is checked against the device's available memory before anything is
evaluated (``engine.kv_cache.check_kv_memory``): too large a ``window`` raises ``KVCacheMemoryError``.

``head="fp8" | "int4"`` (``--quant-head``) adds, for each format, a row with the lm head quantised as well
(``models.quantize.quantize_head``; labelled ``<format>+head-<head>``), and with no block format a row with
the head alone (``head-<head>``): the difference between the two rows is the head's accuracy cost.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

TEXT_PATH = Path(__file__).resolve().parent.parent / "data" / "accuracy_text.txt"


def accuracy_text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


def _windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]


@torch.no_grad()
def _window_logits(model, ids: list[int], device) -> torch.Tensor:
    """fp32 log-probabilities [S, V] of the next token at each position of one window."""
    from fastdecode.engine.kv_cache import KVCache

    cache = KVCache(model.config, 1, len(ids), dtype=model.tok_embeddings.weight.dtype, device=device)
    logits = model.prefill(torch.tensor([ids], device=device), cache)[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_kv_memory(model, window: int, device) -> None:
    """``KVCacheMemoryError`` (a ValueError: one ``error:`` line from the CLI) when one window's KV cache, which
    ``_window_logits`` allocates, would not fit in the device's available memory."""
    from fastdecode.engine.kv_cache import check_kv_memory

    check_kv_memory(model.config, 1, window, model.tok_embeddings.weight.dtype, device,
                    fix="lower --window (window)")


def compare(ref_model, models: dict, ids: list[int], *, window: int = 512, device="cpu") -> list[dict]:
    """Perplexity / top-1 agreement / KL of ``models`` (name -> model) against ``ref_model`` on ``ids``."""
    stats = {name: {"nll": 0.0, "agree": 0, "kl": 0.0} for name in ["reference", *models]}
    n = 0
    for w in _windows(ids, window):
        target = torch.tensor(w[1:], device=device)
        ref = _window_logits(ref_model, w, device)[:-1]  # [S-1, V]: predictions of w[1:]
        ref_top = ref.argmax(-1)
        stats["reference"]["nll"] -= ref.gather(1, target[:, None]).sum().item()
        stats["reference"]["agree"] += len(target)
        for name, m in models.items():
            lp = _window_logits(m, w, device)[:-1]
            st = stats[name]
            st["nll"] -= lp.gather(1, target[:, None]).sum().item()
            st["agree"] += (lp.argmax(-1) == ref_top).sum().item()
            st["kl"] += (ref.exp() * (ref - lp)).sum().item()
        n += len(target)
    return [{"format": name, "perplexity": round(math.exp(st["nll"] / n), 4),
             "top1_agreement": round(st["agree"] / n, 4), "mean_kl": round(st["kl"] / n, 6), "tokens": n}
            for name, st in stats.items()]


def int4_a8_copy(model):
    """A copy of an int4 ``model`` with the ``int4_a8`` switch on (W4A8 with int8 activations) for every row, not only
    decode's up to 4: the activation's rounding is per row, so a window's prefill then computes what each decode step
    of it would (beyond 4 rows with ``int4_linear_a8_ref``). None when no projection can take it (groups not
    multiples of 128)."""
    from fastdecode.models.int4 import Int4Linear
    from fastdecode.ops.int4_a8 import supports

    m = copy.deepcopy(model)
    m.set_kernels(int4_a8=True)
    lins = [x for x in m.modules() if isinstance(x, Int4Linear) and x.act_int8 and supports(x.packed)]
    for x in lins:
        x.a8_max_rows = 1 << 30
    return m if lins else None


def fp8_a16_copy(model, all_projections: bool = False):
    """A copy of an fp8 ``model`` with the ``fp8_a16`` switch (``all_projections``: ``fp8_a16_all``) on for every
    row, not only decode's up to 4: wqkv, wo and w2 (and w13) take their 16-bit activations unquantised (W8A16,
    ``ops.w8a16``; beyond 4 rows its reference; the norms before wqkv (and w13) emit 16-bit rows), so a window's
    prefill computes what each decode step of it would. The model as it is computes W8A8 on a window's rows."""
    from fastdecode.models.llama import Fp8Linear
    from fastdecode.models.rmsnorm import RMSNorm

    m = copy.deepcopy(model)
    m.set_kernels(**{"fp8_a16_all" if all_projections else "fp8_a16": True})
    for x in m.modules():
        if isinstance(x, Fp8Linear) and x.a16_max_rows:
            x.a16_max_rows = 1 << 30
        if isinstance(x, RMSNorm) and x.a16_rows:
            x.a16_rows = 1 << 30
    return m


def eval_accuracy(path: Optional[str] = None, quants: Sequence[str] = ("fp8",), *, head: Optional[str] = None,
                  int4_a8: bool = False, fp8_a16: bool = False, fp8_a16_all: bool = False, device=None, dtype=None,
                  window: int = 512,
                  max_tokens: Optional[int] = None, text: Optional[str] = None, log=print) -> list[dict]:
    """Load ``path`` unquantised and with each of ``quants`` (and each again with the lm head quantised as
    ``head``, or the head alone when ``quants`` is empty); returns one JSON-ready row per format. ``int4_a8``: each
    int4 format again with int8 activations (``int4_a8_copy``; the row says on how many projections); ``fp8_a16``:
    each fp8 format again as its decode steps compute it (W8A16 wqkv, wo and w2: ``fp8_a16_copy``);
    ``fp8_a16_all``: with every projection W8A16."""
    from fastdecode.engine.loader import load
    from fastdecode.models.quantize import FORMATS, check_head, quantize_head

    check_head(head)
    if not quants and head is None:
        raise ValueError("quants is empty and head is None: nothing to evaluate")

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    # gguf_native=False: on CUDA a GGUF's Q4_0 / Q4_1 tensors load as int4 by default; the reference is dense
    ref = load(path, device=device, dtype=dtype, max_seq_len=window, progress=False, gguf_native=False)
    if ref.tokenizer is None:
        raise ValueError(f"{ref.source} has no tokenizer; eval-accuracy needs one to tokenise the text")
    ids = ref.tokenizer.encode(text if text is not None else accuracy_text())
    if max_tokens:
        ids = ids[:max_tokens]
    longest = max((len(w) for w in _windows(ids, window)), default=1)
    _check_kv_memory(ref.model, longest, device)  # early: before the quantised copies are loaded
    models = {}
    for q in quants:
        if q not in FORMATS:
            raise ValueError(f"quant {q!r} cannot be evaluated yet (available: {', '.join(FORMATS)})")
        # RTN on the reference's weights (GGUF: dequantised first), not the file's own int4 tensors
        # (gguf_native=False is the default for fp8 anyway; other formats ignore it)
        m = load(path, device=device, dtype=dtype, max_seq_len=window, progress=False, quant=q,
                 gguf_native=False).model
        models[m.quant_format or FORMATS[q]] = m
        if q == "int4" and str(ref.source).endswith(".gguf"):
            native = load(path, device=device, dtype=dtype, max_seq_len=window, progress=False, quant=q,
                          gguf_native=True).model
            if native.quant_format != m.quant_format:  # the file has Q4_0 / Q4_1 tensors
                models[native.quant_format] = native
        if head is not None:  # the same block weights, the head quantised too: its cost is the difference
            mh = quantize_head(copy.deepcopy(m), head)
            models[mh.format_label] = mh
        if fp8_a16 and q == "fp8":
            models[(m.quant_format or FORMATS[q]) + "+a16"] = fp8_a16_copy(m)
        if fp8_a16_all and q == "fp8":
            models[(m.quant_format or FORMATS[q]) + "+a16all"] = fp8_a16_copy(m, all_projections=True)
        if int4_a8 and q == "int4":
            for name, base in [(k, v) for k, v in models.items() if v.quant == "int4"]:
                if name.endswith("+a8"):
                    continue
                ma = int4_a8_copy(base)
                if ma is None:
                    log(f"{name}: no projection with groups of 128 columns, no int8-activation row")
                    continue
                models[name + "+a8"] = ma
    if head is not None and not quants:
        mh = quantize_head(copy.deepcopy(ref.model), head)
        models[mh.format_label] = mh
    _check_kv_memory(ref.model, longest, device)  # again with every model loaded, before compare allocates
    rows = compare(ref.model, models, ids, window=window, device=device)
    for r in rows:  # how many projections of an int8-activation row run W4A8
        if r["format"].endswith("+a8"):
            from fastdecode.models.int4 import Int4Linear

            lins = [x for x in models[r["format"]].modules() if isinstance(x, Int4Linear)]
            r["a8_projections"] = f"{sum(x.act_int8 and x.a8_max_rows > 4 for x in lins)} of {len(lins)}"
    dt = str(next(ref.model.parameters()).dtype).replace("torch.", "")
    for r in rows:
        r.update(model=ref.config.name or ref.source, device=str(device), dtype=dt, window=window,
                 text=TEXT_PATH.name if text is None else "custom")
        log(f"{r['format']:>30}: perplexity {r['perplexity']:8.3f}  top-1 agreement {r['top1_agreement']:.4f}  "
            f"KL {r['mean_kl']:.5f}  ({r['tokens']} tokens)")
    log(f"[{time.perf_counter() - t0:.1f} s]")
    return rows
