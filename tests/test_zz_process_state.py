"""Guards against test modules that change process-wide state (the GPU-suite regression).

``tests/test_int4.py`` and ``tests/test_gemm.py`` once set ``TRITON_INTERPRET=1`` at import when
conftest had not, which is on every GPU machine: every test collected after them then ran its Triton
kernels in the interpreter, on CUDA tensors, and nearly the whole GPU suite failed, slowly. Each file
passed when run alone. conftest.py alone decides the interpreter, once, before anything imports triton.

The file name sorts last on purpose: the runtime checks see every module the suite imported before it.
"""

import ast
import os
import sys
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent
WRITERS = {"setdefault", "setenv", "putenv", "update", "__setitem__"}


def _writes_of_triton_interpret(path: Path) -> list[int]:
    """Line numbers where ``path`` writes TRITON_INTERPRET into the environment."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WRITERS:
            named = any(isinstance(a, ast.Constant) and a.value == "TRITON_INTERPRET" for a in node.args)
            named |= any(k.arg == "TRITON_INTERPRET" for k in node.keywords)
            named |= any(isinstance(a, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "TRITON_INTERPRET"
                                                         for k in a.keys) for a in node.args)
            if named:
                lines.append(node.lineno)
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign) else [])
        for t in targets:
            if (isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant)
                    and t.slice.value == "TRITON_INTERPRET"):
                lines.append(node.lineno)
    return lines


def test_no_test_module_sets_triton_interpret():
    """Only conftest.py writes TRITON_INTERPRET; tests that need the interpreter skip without it."""
    offenders = {p.name: ln for p in sorted(TESTS.glob("*.py")) if p.name != "conftest.py"
                 if (ln := _writes_of_triton_interpret(p))}
    assert not offenders, f"test modules write TRITON_INTERPRET (file: lines): {offenders}"


def test_the_checker_sees_every_form_of_write(tmp_path):
    """The static check above is not vacuous: each way of setting the variable is caught."""
    forms = ['os.environ.setdefault("TRITON_INTERPRET", "1")', 'os.environ["TRITON_INTERPRET"] = "1"',
             'monkeypatch.setenv("TRITON_INTERPRET", "1")', 'os.putenv("TRITON_INTERPRET", "1")',
             'os.environ.update(TRITON_INTERPRET="1")', 'os.environ.update({"TRITON_INTERPRET": "1"})']
    for i, form in enumerate(forms):
        p = tmp_path / f"m{i}.py"
        p.write_text(f"import os\n\n{form}\n")
        assert _writes_of_triton_interpret(p) == [3], form
    p = tmp_path / "reads.py"
    p.write_text('import os\nx = os.environ.get("TRITON_INTERPRET", "0")\n'
                 'env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}\n')
    assert _writes_of_triton_interpret(p) == []


def test_triton_interpret_unchanged_since_conftest():
    """After every module of the run was imported (this file sorts last), the variable is what
    conftest decided, and every Triton kernel already built is of the kind that decision implies."""
    assert os.environ.get("TRITON_INTERPRET") == conftest.TRITON_INTERPRET_AT_START
    if "triton" not in sys.modules:
        return
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    from triton.runtime.jit import JITFunction
    from triton.runtime.interpreter import InterpretedFunction

    wrong, seen = [], 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fastdecode.kernels.") or mod is None:
            continue
        for attr, obj in vars(mod).items():
            seen += isinstance(obj, (InterpretedFunction, JITFunction))
            if isinstance(obj, InterpretedFunction) and not interpreted:
                wrong.append(f"{name}.{attr} is interpreted")
            elif isinstance(obj, JITFunction) and interpreted:
                wrong.append(f"{name}.{attr} is compiled although the interpreter is on")
    assert not wrong, wrong
    if any(n.startswith("fastdecode.kernels.") for n in sys.modules):
        assert seen, "kernel modules are loaded but no Triton kernel was found in them: the check is blind"
