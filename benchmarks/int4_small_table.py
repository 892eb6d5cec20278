"""Development tool: an int4 config table with the fastest M = 1 tile of each shape of a ``gpu.py int4-small`` sweep
put in (CPU), for timing the embedded SmolLM2 step on those tiles against the shipped table.

Reads the sweep's rows (``benchmarks/sweep_int4_small_fma.py``), a base table (default: the package's H200
``int4_linear`` table) and writes ``int4_linear_<gpu key>.json`` into ``--out-dir``, a directory to point
``FASTDECODE_CONFIG_DIR`` at (with the base's other families copied beside it). Per shape, the fastest int4 tile
of the sweep, if it beat the row of the table's own tile, becomes the M = 1 entry of the op the sweep timed it as
(since session 32 the table has sections for the fused ops, ``fastdecode.ops.int4.FUSED_OPS``: the norm inside for
qkv and gate_up, the residual add for o, SiLU-and-mul and the add for down), over the plain GEMV's entry, which
stays. Session 31's and 32's tables of this kind (``benchmarks/results/h100/configs_*``) replaced the plain entry
instead, which the fused ops then read.

Sweeps after session 32's a7271b7 time each one-split norm tile with and without NORM_LOOP (the int4 FMA kernel's
in-loop norm, opt-in since session 32), and the tile taken carries the key as timed. ``--norm-loop`` sets NORM_LOOP
on the norm shapes' entries (qkv, gate_up), as the sweep at 5006ffb ran them all; ``--norm-loop-only`` gives the
norm shapes the base's tile with NORM_LOOP and nothing else; ``--unchanged`` writes the base as it is (the other
side of ``gpu.py step-tables``).

    python benchmarks/int4_small_table.py sweep_int4_small_fma.json --gpu nvidia_h100_80gb_hbm3 --out-dir /tmp/cfg3
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

from fastdecode.ops._common import CONFIG_DIR as CONFIGS, SIBLING_KINDS, gpu_key, sibling_gpu
NORM_SHAPES = ("smollm2.qkv", "smollm2.gate_up")  # the step's int4_rms_norm_linear calls
# the table section of the op each sweep side times (fastdecode.ops.int4.FUSED_OPS)
SECTIONS = {"norm": "int4_rms_norm_linear", "add": "int4_add_linear", "glu": "int4_add_linear_glu"}


def side(shape: dict) -> str:
    """The op a swept shape ran as: its row's ``side`` (sweeps after a7271b7), else by name (qkv and gate_up the
    norm, the rest the residual add: the sweep at 5006ffb ran down without SiLU-and-mul inside)."""
    return shape.get("side") or ("norm" if shape["name"] in NORM_SHAPES else "add")


def build(rows: list[dict], base: dict, norm_loop: bool = False, norm_loop_only: bool = False,
          source: str = "", unchanged: bool = False) -> dict:
    """The base table copied, with an M = 1 entry for each swept shape in the section of the op it ran as
    (``SECTIONS``; ``fastdecode.ops.int4.FUSED_OPS``: the fused op's entry overrides the plain GEMV's there, which
    stays as it is). A shape gets its entry where a tile beat the row of the table's own tile; with ``norm_loop``
    a norm shape's entry has NORM_LOOP (its own tile's if no tile beat it); with ``norm_loop_only`` every norm
    shape's entry is the base's tile for the op (its section's, else the plain GEMV's) with NORM_LOOP; with
    ``unchanged`` there is none. Entries the sweep did not time stay as the base has them."""
    table = copy.deepcopy(base)
    table["int4_small_source"] = source
    if unchanged:
        return table
    shapes = {}
    for r in rows:
        shapes.setdefault(r["shape"]["name"], []).append(r)
    for name, rs in sorted(shapes.items()):
        s = rs[0]["shape"]
        key, section = f"{s['N']},{s['K']},{s['group']}", SECTIONS[side(s)]
        # the tile the op runs now: its section's entry (shipped since session 33), else the plain GEMV's
        plain = table.get(section, {}).get(key, {}).get("1") or table["int4_linear"][key]["1"]
        own = next(r for r in rs if r["impl"] == "table")
        tiles = [r for r in rs if r.get("config") and r["impl"] != "table"]
        best = min(tiles, key=lambda r: r["median_us"], default=own)
        entry = None
        if not norm_loop_only and best["median_us"] < own["median_us"]:
            entry = {"impl": "triton", "config": dict(best["config"]), "us": best["median_us"]}
        if (norm_loop or norm_loop_only) and section == SECTIONS["norm"] and plain["config"].get("kind") == "fma":
            entry = entry or {"impl": plain["impl"], "config": dict(plain["config"])}
            entry["config"]["NORM_LOOP"] = True
        if entry is not None:
            table.setdefault(section, {}).setdefault(key, {})["1"] = entry
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep", nargs="?", default="",
                   help="a gpu.py int4-small result (sweep_int4_small_fma.json); none with --unchanged")
    p.add_argument("--base", default=str(CONFIGS / "int4_linear_nvidia_h200.json"))
    p.add_argument("--gpu", required=True, help="the table's GPU key (fastdecode.ops._common.gpu_key)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--norm-loop", action="store_true", help="NORM_LOOP on the norm shapes' M = 1 tiles")
    p.add_argument("--norm-loop-only", action="store_true", help="the base's tiles, with NORM_LOOP on the norm shapes")
    p.add_argument("--unchanged", action="store_true", help="the base as it is, under --gpu's name")
    a = p.parse_args()
    if not (a.sweep or a.unchanged):
        p.error("a sweep result is needed unless --unchanged")
    data = json.loads(Path(a.sweep).read_text()) if a.sweep else []
    rows = data["rows"] if isinstance(data, dict) else data
    if a.unchanged:
        what = "nothing changed" + (f" (the other side of {Path(a.sweep).name})" if a.sweep else "")
    elif a.norm_loop_only:
        what = "NORM_LOOP on the norm shapes' M = 1 tiles"
    else:
        what = f"the fastest M = 1 tiles of {Path(a.sweep).name}" + (
            " with NORM_LOOP on the norm shapes" if a.norm_loop else "")
    sha = {r.get("git_sha") for r in rows}
    source = f"{Path(a.base).name} with {what}" + (f" (sweep at {', '.join(sorted(map(str, sha)))})" if rows else "")
    table = build(rows, json.loads(Path(a.base).read_text()), a.norm_loop, a.norm_loop_only, source, a.unchanged)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sibling = sibling_gpu(str(table.get("gpu", "")))
    for fam in ("linear", "allreduce"):  # the base GPU's other tables beside it, under the same GPU key
        src = Path(a.base).with_name(Path(a.base).name.replace("int4_linear", fam))
        if not src.exists() and fam in SIBLING_KINDS and sibling:  # none of the base's GPU (the H100 has an int4
            src = CONFIGS / f"{fam}_{gpu_key(sibling)}.json"  # table only): its sibling's, as the ops read it
        if src.exists():
            shutil.copy(src, out / f"{fam}_{a.gpu}.json")
    (out / f"int4_linear_{a.gpu}.json").write_text(json.dumps(table, indent=1) + "\n")
    for section in SECTIONS.values():
        for key, by_m in table.get(section, {}).items():
            print(section, key, by_m["1"]["config"], by_m["1"].get("us"))


if __name__ == "__main__":
    main()
