"""Does warming the L2 pay? Two ways: the attention kernel prefetches wo's weight (the ``l2_prefetch`` switch; how
much of it?), and every GEMV prefetches its own weight slab before its PDL wait (``weight_prefetch``, a launch
policy: ``fastdecode.ops.set_weight_prefetch``). And does the W8A16 section tuned on the H200 (session 26) beat the
package's for FP8?

One process, one model per format (8B shapes, random weights, batch 1, 1 in / 128 out, as ``bench decode``): the
graph step for each ``--limits`` size of the attention's prefetch in MB (``off``; ``all``: the whole of wo's weight;
``Attention.l2_prefetch_limit``), each without the slabs and with each ``--slab-kb`` cap of a program's slab
(``FASTDECODE_WEIGHT_PREFETCH_KB``), the variants interleaved ``--repeats`` times so that drift hits them alike.
The other table (``--w8a16-table``) runs the plain step only.
``--w8a16-table`` (FP8 only): the same variants again on a copy of the tables in use whose linear table takes that
file's ``w8a16`` section (in-process: ``FASTDECODE_CONFIG_DIR`` and ``clear_config_cache``).

One JSON row per format, table, limit and slab cap: the median of the decode step over every generate of every
repeat, p10 / p90, and the difference to ``off`` without slabs on the same table; a summary on stdout.

    python benchmarks/diag_l2_prefetch.py --formats fp8 int4 int4_a8 --limits off all --slab-kb 64 all --out l2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

QUANT = {"bf16": None, "fp8": "fp8", "int4": "int4", "int4_a8": "int4"}


def _impl(fmt: str, limit: str, slab_kb=None) -> str:
    switches = (["int4_a8"] if fmt == "int4_a8" else []) + ([] if limit == "off" else ["l2_prefetch"])
    switches += [] if slab_kb is None else ["weight_prefetch"]
    return "fastdecode-graph" + (f"-with-{'+'.join(switches)}" if switches else "")


def w8a16_config_dir(section_table: str) -> str:
    """A temporary copy of the tables in use for this GPU whose linear table takes ``section_table``'s ``w8a16``
    section (and its ``w8a16_env``)."""
    from fastdecode.ops._common import gpu_key, table_path

    name = torch.cuda.get_device_name(0)
    d = Path(tempfile.mkdtemp(prefix="fd_w8a16_tables_"))
    for family in ("linear", "int4_linear", "allreduce"):
        src = table_path(family, name)
        if src.is_file():
            shutil.copy(src, d / f"{family}_{gpu_key(name)}.json")
    lin = d / f"linear_{gpu_key(name)}.json"
    table = json.loads(lin.read_text())
    extra = json.loads(Path(section_table).read_text())
    for key in ("w8a16", "w8a16_env"):
        if key in extra:
            table[key] = extra[key]
    lin.write_text(json.dumps(table, indent=1))
    return str(d)


def _run_format(a, fmt: str, model, cfg, cache, gen, tables: dict) -> list[dict]:
    """Every variant of one format, interleaved over ``a.repeats``: one row per (table, limit, slab cap in KB or
    None); a table other than the one in use runs the plain step only (a comparison of configs)."""
    from fastdecode.bench.decode import DecodeRunner
    from fastdecode.bench.harness import env_info
    from fastdecode.ops._tuned import clear_config_cache

    device = cache.device
    variants = [(lim, kb) for lim in a.limits for kb in [None] + list(a.slab_kb)]
    kb_before = os.environ.get("FASTDECODE_WEIGHT_PREFETCH_KB")
    times: dict[tuple, list[float]] = {}
    for rep in range(a.repeats):
        for tname, tdir in tables.items():
            if tdir is None:
                os.environ.pop("FASTDECODE_CONFIG_DIR", None)
            else:
                os.environ["FASTDECODE_CONFIG_DIR"] = tdir
            clear_config_cache()
            for limit, slab_kb in (variants if tname == "in use" else [("off", None)]):
                if slab_kb is not None:  # read at the launches the capture records
                    os.environ["FASTDECODE_WEIGHT_PREFETCH_KB"] = slab_kb
                for layer in model.layers:
                    layer.attention.l2_prefetch_limit = (None if limit in ("off", "all")
                                                         else int(float(limit) * 2**20))
                runner = DecodeRunner(_impl(fmt, limit, slab_kb), model, cache, 1)
                prompts = [torch.randint(0, cfg.vocab_size, (1, 1), device=device, generator=gen)
                           for _ in range(a.iters + 1)]
                runner.generate(prompts[0], 128)  # warm-up
                for pr in prompts[1:]:
                    _, dec = runner.generate(pr, 128)
                    times.setdefault((tname, limit, slab_kb), []).append(dec / 127 * 1e6)
                del runner
                torch.cuda.synchronize()
                print(f"{fmt} [{tname}] attention prefetch {limit}, slabs {slab_kb}: rep {rep} median so far "
                      f"{statistics.median(times[(tname, limit, slab_kb)]):.1f} us", flush=True)
    if kb_before is None:
        os.environ.pop("FASTDECODE_WEIGHT_PREFETCH_KB", None)
    else:
        os.environ["FASTDECODE_WEIGHT_PREFETCH_KB"] = kb_before
    rows = []
    for (tname, limit, slab_kb), ts in times.items():
        ts = sorted(ts)
        base = times.get((tname, "off", None))
        off = statistics.median(base) if base else None
        med = statistics.median(ts)
        rows.append({"op": "diag_l2_prefetch", "format": fmt, "table": tname, "limit_mb": limit, "slab_kb": slab_kb,
                     "impl": _impl(fmt, limit, slab_kb), "median_us": round(med, 2),
                     "p10_us": round(ts[len(ts) // 10], 2), "p90_us": round(ts[(9 * len(ts)) // 10], 2),
                     "n": len(ts), "vs_off_us": round(med - off, 2) if off is not None else None, **env_info()})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["fp8", "int4", "int4_a8"], choices=sorted(QUANT))
    p.add_argument("--limits", nargs="+", default=["off", "4", "8", "all"],
                   help="'off', 'all' or MB of wo's weight to prefetch")
    p.add_argument("--slab-kb", nargs="*", default=[], help="each variant also with the GEMVs' weight-slab prefetch, "
                                                          "at most this many KB a program ('all': the whole slab)")
    p.add_argument("--w8a16-table", default=None, help="fp8: also run on a linear table with this file's w8a16 "
                                                       "section")
    p.add_argument("--iters", type=int, default=10, help="generates of 1 in / 128 out per variant and repeat")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--out", default="diag_l2_prefetch.json")
    a = p.parse_args()

    from fastdecode.bench.decode import build_bench_model
    from fastdecode.engine.kv_cache import KVCache

    base_dir = os.environ.get("FASTDECODE_CONFIG_DIR")
    tables = {"in use": base_dir}
    if a.w8a16_table:
        tables["w8a16 section"] = w8a16_config_dir(a.w8a16_table)
    rows = []
    quants = list(dict.fromkeys(QUANT[f] for f in a.formats))  # int4 and int4_a8 share one model
    for quant in quants:
        built = build_bench_model(a.preset, batch=1, max_seq=129, quant=quant)
        model, cfg, device = built.model, built.config, built.device
        cache = KVCache(model.config, 1, 129, dtype=torch.bfloat16, device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        for fmt in (f for f in a.formats if QUANT[f] == quant):
            rows += _run_format(a, fmt, model, cfg, cache, gen, tables if fmt == "fp8" else {"in use": base_dir})
            with open(a.out, "w") as f:  # what is done so far, in case the call is cut short
                json.dump(rows, f, indent=1)
        del model, cache, built
        torch.cuda.empty_cache()
    if base_dir is None:
        os.environ.pop("FASTDECODE_CONFIG_DIR", None)
    else:
        os.environ["FASTDECODE_CONFIG_DIR"] = base_dir
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['format']:<8} {r['table']:<14} {r['limit_mb']:>4} slabs {r['slab_kb']!s:<5} "
              f"{r['median_us']:8.1f} us  (p10 {r['p10_us']:.1f}, p90 {r['p90_us']:.1f}, n {r['n']})  "
              f"vs off {r['vs_off_us']}")


if __name__ == "__main__":
    main()
