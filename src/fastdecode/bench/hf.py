"""``fastdecode bench hf``: Hugging Face transformers' ``generate`` on a Llama, plain and patched by
``fastdecode.integrations.transformers.apply``, in one process (the plain row is the baseline).

Method: a random-weight ``LlamaForCausalLM`` of a fastdecode preset's shapes (default ``llama-3.1-8b``; ``layers``
keeps the first N layers), one fresh model per variant built from the same seed (the same weights); ``batch``
prompts of ``input_len`` random tokens, then ``output_len`` greedy tokens (``min_new_tokens`` = ``max_new_tokens``:
no early stop), ``warmup`` runs then ``iters`` timed runs; we report medians. Variants (``impl`` of the rows):

* ``plain``                transformers as shipped, eager, its default dynamic cache
* ``plain-compile``        ``cache_implementation="static"``: transformers compiles the decode step itself
                           (``CompileConfig(fullgraph=True)``, Inductor ``mode="reduce-overhead"`` on CUDA)
* ``patched``              ``apply(model)``: fused add + RMSNorm, RMSNorm, gate | up + SiLU-and-mul; eager
* ``patched-compile``      the same, static cache, compiled as ``plain-compile``
* ``patched-fp8``, ``patched-int4``   ``apply(model, linear="fp8" | "int4")``, eager
* extra (``--variants``): ``patched-fp8-compile``, ``patched-int4-compile``

Timing: wall clock around ``generate`` (CUDA synchronised before and after); a logits processor notes the time
once, after the prefill's forward (one synchronisation), so ``ms_per_step`` is the decode part over
``output_len - 1`` steps and ``prefill_ms`` the rest. ``tokens_per_s`` = ``batch * output_len`` / the whole
``generate``; ``speedup_vs_plain`` divides it by the plain row's; ``tokens_match_plain`` is the fraction of the
first timed run's tokens equal to plain's (random weights: near-ties flip; a sanity figure, not accuracy).
``bytes`` (and ``tbps``): the weights one step reads, every parameter but the embedding table (``batch`` rows).

On a CPU (``device="cpu"``, a tiny preset) every variant runs, for testing; there ``compile_backend`` (e.g.
``"aot_eager"``) avoids Inductor's C++ build. transformers is imported inside the functions (it is optional).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Optional, Sequence

import torch

VARIANTS = ("plain", "plain-compile", "patched", "patched-compile", "patched-fp8", "patched-int4")
EXTRA_VARIANTS = ("patched-fp8-compile", "patched-int4-compile")
DEFAULT_OUT = "benchmarks/results/hf.json"


def hf_llama_config(cfg, dtype: torch.dtype):
    """A transformers ``LlamaConfig`` of a fastdecode ``ModelConfig`` (shapes, RoPE, eps; no special tokens)."""
    import transformers

    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
              head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
              rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None,
              eos_token_id=None, pad_token_id=0, dtype=dtype)
    rs = cfg.rope_scaling
    if rs is not None:
        kw["rope_scaling"] = (
            {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
             "high_freq_factor": rs.high_freq_factor,
             "original_max_position_embeddings": rs.original_max_position_embeddings}
            if rs.type == "llama3" else {"rope_type": "linear", "factor": rs.factor})
    return transformers.LlamaConfig(**kw)


def build_model(hf_cfg, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight ``LlamaForCausalLM`` on ``device`` in ``dtype`` (built there: no fp32 copy on the host)."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(hf_cfg, dtype=dtype)
    return model.eval()


def parse_variant(v: str) -> tuple[bool, Optional[str], bool]:
    """``(patched, linear, compiled)`` of a variant name."""
    if v not in VARIANTS + EXTRA_VARIANTS:
        raise ValueError(f"unknown variant {v!r}; known: {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    parts = v.split("-")
    linear = next((p for p in parts if p in ("fp8", "int4")), None)
    return parts[0] == "patched", linear, parts[-1] == "compile"


def step_weight_bytes(model, batch: int) -> int:
    """Bytes of the weights one decode step reads: every parameter once (int4: packed bytes), the embedding table
    replaced by ``batch`` of its rows (unless the lm head shares it)."""
    from fastdecode.models.int4 import Int4Linear
    from fastdecode.models.llama import unique_param_bytes

    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            seen |= {id(p) for p in m.parameters()}
            total += m.weight_bytes()
    total += unique_param_bytes(model.parameters(), seen)
    emb = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not emb:
        total -= (emb.shape[0] - min(batch, emb.shape[0])) * emb.shape[1] * emb.element_size()
    return total


class _PrefillClock:
    """A logits processor that notes the time at its first call (after the prefill's forward), once synchronised."""

    def __init__(self, device: torch.device):
        self.device, self.t = device, None

    def __call__(self, input_ids, scores):
        if self.t is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.t = time.perf_counter()
        return scores


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, prompt, output_len: int, compiled: bool, compile_config, device):
    """(output tokens [B, output_len], seconds of the whole generate, seconds until the prefill's logits)."""
    from transformers import LogitsProcessorList

    clock = _PrefillClock(device)
    kw = dict(cache_implementation="static", compile_config=compile_config) if compiled else dict(disable_compile=True)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=output_len,
                         min_new_tokens=output_len, do_sample=False, logits_processor=LogitsProcessorList([clock]),
                         **kw)
    _sync(device)
    t1 = time.perf_counter()
    return out[:, prompt.shape[1]:], t1 - t0, clock.t - t0


def _compile_config(backend: str, device: torch.device):
    from transformers import CompileConfig

    mode = "reduce-overhead" if backend == "inductor" and device.type == "cuda" else None
    cc = CompileConfig(fullgraph=True, backend=backend, mode=mode)
    if device.type != "cuda":
        cc._compile_all_devices = True  # transformers compiles on CUDA (and a few others) only unless told
    return cc


def bench_hf(preset: str = "llama-3.1-8b", *, layers: Optional[int] = None, device=None, dtype=torch.bfloat16,
             batch: int = 1, input_len: int = 1, output_len: int = 128, iters: int = 10, warmup: int = 3,
             variants: Sequence[str] = VARIANTS, compile_backend: str = "inductor", log=print) -> list[dict]:
    """Run the variants; returns JSON-ready rows (``bench.harness.make_row``), the plain row first when measured."""
    import transformers

    from fastdecode.bench.harness import Timing, make_row
    from fastdecode.integrations.transformers import apply
    from fastdecode.models.config import ModelConfig

    for v in variants:
        parse_variant(v)
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 (one token from prefill, the rest from decode), got {output_len}")
    if input_len < 1 or batch < 1 or iters < 1 or warmup < 0:
        raise ValueError(f"batch, input_len, iters must be >= 1 and warmup >= 0, got {batch}, {input_len}, "
                         f"{iters}, {warmup}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = ModelConfig.from_preset(preset)
    if layers:
        cfg = cfg.replace(n_layers=layers)
    hf_cfg = hf_llama_config(cfg, dtype)
    shape = {"model": cfg.name + (f"[{layers} layers]" if layers else ""), "batch": batch, "input_len": input_len,
             "output_len": output_len, "dtype": str(dtype).replace("torch.", "")}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (batch, input_len), generator=gen).to(device)
               for _ in range(warmup + iters)]
    order = sorted(variants, key=lambda v: v != "plain")  # the baseline first: the others compare with it
    rows, plain_tokens = [], None
    for v in order:
        patched, linear, compiled = parse_variant(v)
        model = None
        try:
            model = build_model(hf_cfg, device, dtype)
            if patched:
                apply(model, linear=linear)
            cc = _compile_config(compile_backend, device) if compiled else None
            torch._dynamo.reset()  # each variant compiles its own model
            for p in prompts[:warmup]:
                _generate(model, p, output_len, compiled, cc, device)
            runs = [_generate(model, p, output_len, compiled, cc, device) for p in prompts[warmup:]]
            wbytes = step_weight_bytes(model, batch)
        except Exception as e:  # one failing variant must not hide the others
            log(f"{v}: failed: {type(e).__name__}: {e}")
            rows.append(make_row("hf_generate", v, shape, None, error=e, transformers=transformers.__version__))
            continue
        finally:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        step_us = sorted((total - pre) / (output_len - 1) * 1e6 for _, total, pre in runs)
        t = Timing(statistics.median(step_us), step_us[len(step_us) // 10],
                   step_us[min(len(step_us) - 1, (9 * len(step_us)) // 10)], len(step_us))
        tokens = runs[0][0]
        if v == "plain":
            plain_tokens = tokens
        row = make_row("hf_generate", v, shape, t, bytes_moved=wbytes,
                       tokens_per_s=round(batch * output_len / statistics.median(r[1] for r in runs), 2),
                       ms_per_step=round(t.median_us / 1e3, 3),
                       prefill_ms=round(statistics.median(r[2] for r in runs) * 1e3, 3),
                       step_weight_bytes=wbytes, transformers=transformers.__version__,
                       compile_backend=compile_backend if compiled else None)
        if plain_tokens is not None:
            row["tokens_match_plain"] = round((tokens == plain_tokens).float().mean().item(), 4)
        rows.append(row)
        log(f"{v:>20}: {row['ms_per_step']:9.3f} ms/step  {row['tokens_per_s']:9.1f} tok/s  {row['tbps']:.2f} TB/s")
    base = next((r for r in rows if r["impl"] == "plain" and r.get("tokens_per_s")), None)
    for r in rows:
        if base is not None and r.get("tokens_per_s"):
            r["speedup_vs_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    return rows


__all__ = ["DEFAULT_OUT", "EXTRA_VARIANTS", "VARIANTS", "bench_hf", "build_model", "hf_llama_config",
           "parse_variant", "step_weight_bytes"]
