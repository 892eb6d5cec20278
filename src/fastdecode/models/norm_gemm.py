"""The decode step with each block's RMSNorms inside the GEMMs after them and the residual adds inside the GEMMs
before them: the ``norm_gemm`` kernel switch of ``Transformer`` (on by default).

A block is then ``rms_norm_linear(h, wqkv) -> attention -> add_linear_(h, wo) -> rms_norm_linear(h, w13) ->
add_linear_(h, w2)`` (w2 with SiLU-and-mul in its loads): 5 kernels instead of 7, the residual stream ``h`` updated
in place by wo and w2 (``fastdecode.ops.norm_linear``, which says how the roundings differ from the two-kernel
path). The final norm stays a kernel of its own before the lm head.

It applies where the switch and ``fused_norm`` are on, where fastdecode's Triton kernels run (backend ``"auto"`` on
CUDA, or ``"triton"``; not the ``"torch"`` backend, nor the ``"ref"`` baseline), on one GPU (under TP the norm
owns the all-reduce), not while ``torch.compile`` traces the decode step, and where each of the four projections
of every block is a plain ``Linear`` (bf16 / fp16 / fp32) or, in a bf16 / fp16 model, a W4A16 ``Int4Linear`` for
which the int4 table picks the FMA kernel at one token, or, in a bf16 / fp16 model, an ``Fp8Linear`` that runs
W8A16 at the step's batch (``fp8_a16``, up to 4 rows). The int4 projections take the int4 ops of
``ops.int4_norm_linear`` (the norm weight stays in their kernels: it cannot be folded into int4 weights), and w2
takes SiLU-and-mul as a kernel of its own, as on the unfused path: 6 kernels a block instead of 8, unless the
``int4_glu`` switch (on by default since session 31) has w2's FMA kernel compute SiLU-and-mul in its loads: 5
kernels. That holds where w2 has at most ``INT4_GLU_MAX_K`` input features, or more where the int4 table holds
the GLU op's own entry for w2's shape at the step's rows (``_int4_glu``: a tile the fused tuner timed with
SiLU-and-mul inside; since session 45 it proposes PACKED tiles, which session 11's measurement predates). On an
H100, on the embedded SmolLM2's step (w2's K = 1536; the H200's tables), it measured 610.3 against 620.7 us, 609.9
against 620.2, and 618.15 against 625.85 in three processes. On the 8B (K = 14336), where the K loop is
issue-bound, SiLU in the int4 kernel's loads cost 201 us a step in session 11, and 152-194 us with the fused
tuner's PACKED tiles (session 46, H100: w2 + add 23.17 against 15.96 us; the fused step 2523 against 2371 us
without it, and against 2329 us unfused; the fused 8B sections were not adopted). The limit lies between the two
measured sizes and is not measured itself.

FP8 blocks (session 26) take ``ops.w8a16``'s ``rms_norm_linear_w8a16`` / ``add_linear_w8a16_``: the attention norm
inside wqkv's W8A16 GEMV, the residual adds in wo's and w2's epilogues (SiLU-and-mul in w2's loads). w13 keeps W8A8
after its norm kernel (FP8 output; the residual add has moved into wo), or with ``fp8_a16_all`` takes the norm
inside its W8A16 GEMV too: 5 kernels a block (4 with ``fp8_a16_all``) instead of 6. The norm weights stay in the
kernels, as for int4: folding them into FP8 weights would round those weights to FP8 a second time. Beyond the
W8A16 rows (batch > 4, or ``fp8_a16`` off) an FP8 model keeps the unfused step.

Why FMA only (session 18, H200, c13d239): every program of a fused int4 kernel then first summed its rows' squares
over the whole of K (since session 31 the FMA kind with one split does it inside its K loop). In the FMA kernel (few
tokens a program) that pass paid for itself: SmolLM2 Q4_1 shapes at M = 1 and 4 and 8B at M = 1 ran faster fused
than as the two kernels (``benchmarks/sweep_int4_norm_gemv.py``), and the embedded model's graph step went from
648.2 to 605.7 us. The tensor-core kernels (tiles of 16 tokens, many more programs) lost: 8B gate_up at M = 1 (mma)
46.18 against 31.51 us, qkv at M = 4 17.90 against 13.50; the 8B int4 step with every block fused took 3431.1 us
against 2619.2 unfused. A model with any int4 projection on another kind keeps the unfused path (the tile of the op the
projection runs as, at the step's rows: since session 34 w2 is asked as ``int4_add_linear_glu`` where it takes
SiLU-and-mul in its loads, and the tile is the one for the batch's rows, no longer always one token's), and
``int4_rms_norm_linear`` itself runs the norm kernel first where its dispatch picks a tensor-core kind (larger M).
Where the int4 table holds a projection's shape, the fused step also needs the fused op's own section entry at the
step's rows (``ops.int4.fused_entry_is_own``: a tile timed as the fused op), not the plain GEMV's entry it falls
back to: on the embedded SmolLM2 (fused sections at one token only) the fused step at 4 rows ran 928.4 us against
797.2 unfused, at one token 586.5 against 668.4 (H100, the H200's tables, session 35).

The norm weights are folded into wqkv / w13 (``fold``): ``W[n, k] <- W[n, k] * g[k]`` (fp32 product, one
rounding) and ``g <- 1``, in place, so the model's parameters keep computing the same function on every path (the
unfused path then multiplies by ones) and the fused GEMV does no per-step work for g. Measured (session 16,
``benchmarks/sweep_norm_gemv.py``, H200, M = 1): with g in the kernel, the 8B qkv / gate_up GEMVs took 18.11 /
64.52 us against 15.09 / 56.21 for the plain GEMVs (slower than the norm kernel plus the GEMV, 17.29 / 58.73);
folded, 15.30 / 56.85; the 8B bf16 step 3962.7 against 4030.5 us without the switch (252.3 against 248.0 tok/s,
same process; ``benchmarks/NOTES.md``, session 16). The fold runs at the first eager decode on this path, and again
after any in-place change of those weights (a reload): each block remembers the version counters of the tensors
it folded. A CUDA-graph capture on stale weights raises (its warm-up steps, eager, fold first:
``engine.cuda_graph``).

The prefill keeps the unfused kernels, so the K / V a decode step writes differ from those a prefill of the same
tokens writes by a few bf16 ulps (the normed activation not rounded, the folded weights; session 17, H200,
``benchmarks/diag_norm_gemm.py``: up to 0.039 on 8B-shaped layer-1 rows of rms ~1.3, logits within 0.049 of their
rms; a replayed step equals the eager step exactly).

``l2_prefetch`` (opt-in; ``Attention.attend``, on this path and the unfused one): the attention kernel prefetches wo's
weight bytes into L2 (``fastdecode.models.decode_attention.wo_prefetch``).

``attn_wo`` (opt-in; this path only): a block whose wo is dense or W4A16 int4 takes the attention and wo's residual
add as one kernel (``ops.attention_wo``, where it ``applies``; ``models.decode_attention.wo_fusable``): 4 kernels a
block instead of 5. Not measured on a GPU yet, so off by default.
"""

from __future__ import annotations

import torch

from fastdecode.models.decode_attention import attend_add_wo, wo_fusable, wo_weight
from fastdecode.ops.activation import silu_and_mul, silu_and_mul_ref
from fastdecode.ops.attention_wo import applies as attention_wo_applies
from fastdecode.ops.int4_norm_linear import int4_add_linear_, int4_rms_norm_linear
from fastdecode.ops.norm_linear import add_linear_, fold_norm_weight, rms_norm_linear
from fastdecode.ops.w8a16 import add_linear_w8a16_, rms_norm_linear_w8a16

# the largest int4 w2 input size (intermediate size) that takes SiLU-and-mul in its loads with ``int4_glu``: above the
# embedded SmolLM2's 1536 (faster), below the 8B's 14336 (slower in sessions 11 and 46); the value itself is not
# measured
INT4_GLU_MAX_K = 4096


def _projections(layer):
    a, f = layer.attention, layer.feed_forward
    return a.wqkv, a.wo, f.w13, f.w2


def _dense(proj) -> bool:
    from fastdecode.models.llama import Linear

    return isinstance(proj, Linear)


def _supported(proj, dtype, batch: int, op: str) -> bool:
    """Whether the projection takes this path at ``batch`` rows, run as ``op`` (``_ops``: ``int4_rms_norm_linear``
    after a norm, wqkv and w13; ``int4_add_linear`` or, with SiLU-and-mul in its loads, ``int4_add_linear_glu``)."""
    from fastdecode.models.int4 import INT4_ACT_DTYPES, Int4Linear
    from fastdecode.ops.int4 import fused_entry_is_own, get_int4_config
    from fastdecode.ops.w8a16 import X_DTYPES as W8A16_X_DTYPES

    if _dense(proj):
        return True
    if _fp8(proj):
        # W8A16 (fp8_a16) for these rows; a W8A8 w13 keeps its norm kernel (FP8 output), the residual add moves
        return dtype in W8A16_X_DTYPES and (_a16(proj, batch) or op == _NORM_OP)
    if not (isinstance(proj, Int4Linear) and dtype in INT4_ACT_DTYPES) or proj.act_int8:
        return False  # W4A8 (int4_a8) quantises its activation: the W4A16 norm ops do not apply
    # the tile the op's dispatch gives these rows (its own table section, else the plain GEMV's entry)
    shape = (batch, proj.out_features, proj.in_features, proj.group_size, proj.qweight.device)
    impl, cfg = get_int4_config(*shape, op=op)
    if not (impl == "triton" and cfg["kind"] == "fma"):  # the kind where the fused norm pays (module docstring)
        return False
    # where the table holds the shape, only a tile timed as the fused op at these rows: the plain GEMV's entry, run
    # with the norm or SiLU-and-mul inside, made the embedded SmolLM2's step 131 us slower than the unfused one at
    # 4 rows (H100, session 35: 928.4 against 797.2 us; its fused sections hold one token only)
    return fused_entry_is_own(*shape, op=op) is not False


_NORM_OP = "int4_rms_norm_linear"  # the op of a projection after a norm (wqkv, w13)


def _ops(model, layer, batch: int) -> tuple:
    """The int4 op each of the block's projections (wqkv, wo, w13, w2) runs as on this path (``decode``) at ``batch``
    rows; for the other weights the names say only where the projection sits (after a norm, or adding into the
    residual)."""
    glu = _w2_glu(model, layer.feed_forward, batch)
    return _NORM_OP, "int4_add_linear", _NORM_OP, "int4_add_linear_glu" if glu else "int4_add_linear"


def _a16(proj, batch: int) -> bool:
    """An ``Fp8Linear`` that runs W8A16 at ``batch`` rows (the ``fp8_a16`` switches)."""
    from fastdecode.ops.w8a16 import MAX_M

    return 0 < batch <= min(proj.a16_max_rows, MAX_M)


def applies(model, batch: int = 1) -> bool:
    """Whether ``model.decode`` of ``batch`` sequences takes this path (module docstring)."""
    k = model.kernels
    if not (k["norm_gemm"] and k["fused_norm"]) or model.tp is not None:
        return False
    if torch.compiler.is_compiling():  # the fold's checks sync and mutate: a traced decode takes the unfused path
        return False
    # where the Triton kernels run: "auto" on CUDA, or "triton" (the interpreter on a CPU); the "torch" backend and
    # "auto" on a CPU (plain PyTorch) would gain nothing from the fold, and the "ref" baseline keeps its path
    on_cuda = model.tok_embeddings.weight.device.type == "cuda"
    if not (model.backend == "triton" or (model.backend == "auto" and on_cuda)):
        return False
    dtype = model.tok_embeddings.weight.dtype
    return all(_supported(p, dtype, batch, op) for layer in model.layers
               for p, op in zip(_projections(layer), _ops(model, layer, batch)))


def _pairs(layer):
    """(norm, the dense projection it feeds) of a block: the norm weights ``fold`` moves into the projections (an
    int4 projection keeps its norm's weight)."""
    pairs = ((layer.attention_norm, layer.attention.wqkv), (layer.ffn_norm, layer.feed_forward.w13))
    return tuple((n, p) for n, p in pairs if _dense(p))


def _key(norm, proj) -> tuple:
    g, w = norm.weight, proj.weight
    return g.data_ptr(), g._version, w.data_ptr(), w._version


@torch.no_grad()
def fold(model) -> int:
    """Fold each block's norm weights into wqkv / w13 in place (module docstring) where they are not folded yet;
    returns how many weights changed (a norm weight of ones needs no change)."""
    changed = 0
    for layer in model.layers:
        for norm, proj in _pairs(layer):
            if getattr(norm, "_folded_into", None) == _key(norm, proj):
                continue
            g = norm.weight
            if not bool((g == 1).all()):
                proj.weight.copy_(fold_norm_weight(proj.weight, g))
                g.fill_(1)
                changed += 1
            norm._folded_into = _key(norm, proj)
    return changed


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _folded(model) -> bool:
    return all(getattr(n, "_folded_into", None) == _key(n, p) for layer in model.layers for n, p in _pairs(layer))


def _norm_linear(h, norm, proj, be):
    """The norm, then the projection, as one kernel: a dense weight has the norm weight folded in (a norm without
    weight), an int4 or FP8 weight takes it in the kernel; a W8A8 projection takes the norm kernel's FP8 output."""
    if _dense(proj):
        return rms_norm_linear(h, None, proj.weight, proj.bias, eps=norm.eps, backend=be, impl=proj.gemm_impl)
    if _fp8(proj):
        if not _a16(proj, h.shape[0]):  # W8A8 w13 (fp8_a16 without fp8_a16_all)
            return proj(norm(h, be), be)  # the norm emits FP8
        return rms_norm_linear_w8a16(h, norm.weight, proj.weight, proj.weight_scale, proj.bias, eps=norm.eps,
                                     backend=be)
    return int4_rms_norm_linear(h, norm.weight, proj.packed, proj.bias, eps=norm.eps, backend=be,
                                impl=proj.impl if h.is_cuda else None)


def _int4_glu(model, w2, batch: int) -> bool:
    """SiLU-and-mul in an int4 w2's loads: the ``int4_glu`` switch, for w2 of small K, or of a larger K where the int4
    table holds the GLU op's own entry for w2's shape at ``batch`` rows, a tile timed with SiLU-and-mul inside
    (``bench.int4_fused``; no shipped table has one: at the 8B's K the fused tuner's GLU entry lost, session 46)."""
    if not model.kernels["int4_glu"]:
        return False
    if w2.in_features <= INT4_GLU_MAX_K:
        return True
    from fastdecode.ops.int4 import fused_entry_is_own

    return fused_entry_is_own(batch, w2.out_features, w2.in_features, w2.group_size, w2.qweight.device,
                              op="int4_add_linear_glu") is True


def _w2_glu(model, f, batch: int) -> bool:
    """Whether the feed-forward ``f``'s w2 takes SiLU-and-mul in its loads on this path (``decode``) at ``batch``
    rows."""
    return f.fuse_down and f.fused and (_dense(f.w2) or _fp8(f.w2) or _int4_glu(model, f.w2, batch))


def _add_linear(h, x, proj, be, glu: bool = False) -> None:
    """h += proj(x) in place (``glu``: x is ``[gate | up]``; an int4 projection only with ``int4_glu``)."""
    if _dense(proj):
        add_linear_(h, x, proj.weight, proj.bias, glu=glu, backend=be, impl=proj.gemm_impl)
    elif _fp8(proj):
        add_linear_w8a16_(h, x, proj.weight, proj.weight_scale, proj.bias, glu=glu, backend=be)
    else:
        int4_add_linear_(h, x, proj.packed, proj.bias, glu=glu, backend=be, impl=proj.impl if h.is_cuda else None)


def _fp8(proj) -> bool:
    from fastdecode.models.llama import Fp8Linear

    return isinstance(proj, Fp8Linear)


def decode(model, tokens: torch.Tensor, input_pos: torch.Tensor, cache, seq_lens) -> torch.Tensor:
    """``Transformer.decode`` on this path: tokens, input_pos [B] -> fp32 logits [B, V]."""
    if not _folded(model):
        if _capturing():
            raise RuntimeError("norm_gemm: the norm weights are not folded into wqkv / w13 yet (first use, or "
                               "weights changed since); run one eager decode step before capturing a CUDA graph")
        fold(model)
    B = tokens.shape[0]
    be = model.backend
    h = model._embed(tokens.view(B, 1))  # [B, 1, dim]: the residual stream, a fresh tensor updated in place
    # the attention and wo's residual add as one kernel (opt-in) where one split serves the cache and wo is small
    a0 = model.layers[0].attention
    attn_wo = (model.kernels["attn_wo"] and wo_fusable(a0)
               and attention_wo_applies(B, a0.n_heads, cache.k[0][:B], wo_weight(a0)))
    for i, layer in enumerate(model.layers):
        wqkv, wo, w13, w2 = _projections(layer)
        a, f = layer.attention, layer.feed_forward
        qkv = _norm_linear(h, layer.attention_norm, wqkv, be)
        if attn_wo and wo_fusable(a):  # the attention and wo's residual add in one kernel
            attend_add_wo(a, h, qkv, model.rope, cache.k[i], cache.v[i], input_pos, be)
        else:
            _add_linear(h, a.attend(qkv, model.rope, cache.k[i], cache.v[i], input_pos, seq_lens, be), wo, be)
        gu = _norm_linear(h, layer.ffn_norm, w13, be)
        if _w2_glu(model, f, B):  # SiLU-and-mul in w2's loads
            _add_linear(h, gu, w2, be, glu=True)
        else:
            _add_linear(h, silu_and_mul(gu, backend=be) if f.fused else silu_and_mul_ref(gu), w2, be)
    return model._head(model.norm(h, be)).view(B, -1)


__all__ = ["INT4_GLU_MAX_K", "applies", "decode", "fold"]
