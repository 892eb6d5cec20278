"""Where the warm start-up of ``fastdecode generate`` spends its time, function by function (cProfile).

``fastdecode bench startup`` times the phases; this runs the same child (``bench.startup.child``: the embedded
SmolLM2 GGUF, native int4 on CUDA) in fresh processes, the first to fill the Triton cache if it is empty, the last
under cProfile, and prints its phases and the functions with the most time (own and cumulative). The warm
``kernel_warmup`` phase (0.53 s of the H200's 3.38 s to ready, session 33) is the target: with every kernel in the
Triton cache, it is the first call of each kernel specialisation (Triton's cache lookup, module load, launcher) and
the eager warm-up steps before the capture.

    PYTHONPATH=src python benchmarks/profile_startup.py --out-dir DIR [--runs 2] [--max-batch 1] [--top 45]

Writes ``DIR/startup.prof`` (``python -m pstats``) and ``DIR/startup_profile.txt`` (what it prints).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = ("import sys, time; w0 = time.time(); t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
         "import cProfile; pr = cProfile.Profile(); pr.enable(); "
         "from fastdecode.bench.startup import child; child(w0, t0, t1, sys.argv[1:3]); pr.disable(); "
         "pr.dump_stats(sys.argv[3])")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--runs", type=int, default=2, help="fresh processes; the last one's profile is kept")
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--graph-capture", choices=("eager", "lazy"), default="eager")
    p.add_argument("--device", default="cuda")
    p.add_argument("--top", type=int, default=45)
    a = p.parse_args(argv)
    import pstats

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"model": None, "quant": None, "quant_head": None, "device": a.device, "dtype": None, "backend": None,
           "max_batch": a.max_batch, "graph_capture": a.graph_capture, "prompt": "Why is the sky blue?"}
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    text = io.StringIO()
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.runs):
            res_path, prof = os.path.join(d, f"res{i}.json"), str(out / "startup.prof")
            r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), res_path, prof], env=env,
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
                return r.returncode
            res = json.loads(Path(res_path).read_text())
            print(f"run {i + 1}: ready {res['ready_s']:.3f} s, first token {res['total_s']:.3f} s (under cProfile)",
                  file=text)
    print("phases of the last run (s): " + ", ".join(f"{k} {v:.3f}" for k, v in res["phases"].items()), file=text)
    for key in ("tottime", "cumulative"):
        print(f"\n--- by {key} ---", file=text)
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(a.top)
    print(text.getvalue())
    (out / "startup_profile.txt").write_text(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
