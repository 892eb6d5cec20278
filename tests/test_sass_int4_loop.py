"""``benchmarks/sass_int4_loop.py``: where the int4 FMA kernel's K loop issues its global loads (sm_90 SASS, compiled
on the CPU; session 31)."""

import json
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    return load_script(ROOT / "benchmarks" / "sass_int4_loop.py", "sass_int4_loop")


SASS = """
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
.L_x_1:
        /*0010*/                   LDG.E.64 R8, desc[UR4][R6.64] ;
        /*0020*/                   FFMA R1, R2, R3, R1 ;
        /*0030*/                   LDG.E.U16 R9, desc[UR4][R6.64] ;
        /*0040*/               @P0 LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   LDG.E.64 R8, desc[UR4][R6.64] ;
        /*0070*/               @P1 BRA `(.L_x_2) ;
"""


def test_loop_loads_take_the_loop_with_the_weight_words(tool):
    """The loop whose body holds a 128-bit load (the K loop), each load at its place in the body; the load before
    the loop and the second loop's (no 128-bit load) are not counted."""
    assert tool.loop_loads(SASS) == [(0.2, "LDG.E.64"), (0.6, "LDG.E.U16"), (0.8, "LDG.E.128")]
    with pytest.raises(ValueError, match="no K loop"):
        tool.loop_loads(SASS.replace("@P0 LDG.E.128", "@P0 LDG.E.64"))


def test_the_kernel_compiles_and_its_next_words_come_late_in_the_loop():
    """The real kernel for sm_90 (the embedded model's format, BLOCK_N 16 on 4 warps), through the script in a
    process without the interpreter (as ``helpers.sm90_ptx``): the next step's words load inside the loop, after its
    first loads (what PREFETCH 2 works around). Skips where this machine cannot compile for sm_90."""
    from helpers import sm90_output

    out = sm90_output(str(ROOT / "benchmarks" / "sass_int4_loop.py"), "--json", skip_on=("ptxas", "nvdisasm"))
    loads = [(d["at"], d["op"]) for d in json.loads(out)]
    words = [at for at, op in loads if op == "LDG.E.128"]
    assert len(words) == 1 and words[0] > min(at for at, _ in loads), loads
