"""The import graph of the ``fastdecode`` package, built statically (``ast``; nothing is imported).

Layer rules and the reasons behind them: ``docs/architecture.md`` ("Layers and the import rules").

Every module under ``src/fastdecode`` is parsed. Each ``import fastdecode.x``, ``from fastdecode.x import y``
and relative import becomes an edge to the module it names (``from pkg import sub`` to the submodule
``pkg.sub`` when that is a module, else to ``pkg``), recorded as **module-level** (runs when the module is
imported: top level, class bodies, ``try`` / ``if`` blocks) or **function-level** (inside a ``def`` or
``lambda``: runs when called, the usual way to break a cycle). Imports under ``if TYPE_CHECKING:`` never
run and are left out. The implicit import of parent packages (``import a.b.c`` runs ``a/__init__`` and
``a/b/__init__``) is not an edge: a package being initialised is already in ``sys.modules``.

Tests:

* no import cycle among module-level imports, except the cycles in ``KNOWN_CYCLES``, each of which must
  still exist (delete an entry when its cycle is gone);
* no module longer than ``MAX_LINES``, except those in ``KNOWN_LONG_MODULES``, each of which must still be
  over the limit (delete an entry when its module is split).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = "fastdecode"
MAX_LINES = 500

#: Module-level import cycles that exist today, each a strongly connected component of the module-level
#: graph (module names without the ``fastdecode.`` prefix), with the issue item that removes it.
#: Empty: the module-level graph had no cycle when this list was set (the last mutual import, engine.cli <->
#: engine.bench_decode, function-level on both sides, went with the one CLI package, issue 13 item 2). An entry
#: looks like ``frozenset({"engine.loader", "engine.tp"}): "issue N item M (what removes it)"``.
KNOWN_CYCLES: dict[frozenset[str], str] = {}

#: Modules over MAX_LINES lines today (line count when this list was set) and the issue item that splits them.
#: Item numbers are given where the issue names them; the others say which change of issue 13 removes them.
KNOWN_LONG_MODULES: dict[str, str] = {}


def _short(mod: str) -> str:
    return mod[len(PKG) + 1:] if mod.startswith(PKG + ".") else mod


def discover_modules(src: Path = SRC) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every ``.py`` file under ``src/fastdecode``."""
    mods = {}
    for path in sorted((src / PKG).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def build_graph(mods: dict[str, tuple[Path, bool]]) -> dict[tuple[str, str], set[str]]:
    """(importer, imported) -> the kinds of that import: {"module"}, {"function"} or both."""

    def resolve(name: str):
        while name and name not in mods:  # `from pkg.mod import func` -> pkg.mod
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[tuple[str, str], set[str]] = {}

    def add(src_mod, target, kind):
        if target is not None and target != src_mod:
            edges.setdefault((src_mod, target), set()).add(kind)

    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        base = mod if is_pkg else mod.rpartition(".")[0]

        def visit(node, in_function: bool):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    for stmt in child.orelse:  # the body never runs; an else branch does
                        visit(ast.Module(body=[stmt], type_ignores=[]), in_function)
                    continue
                kind = "function" if in_function else "module"
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        if alias.name == PKG or alias.name.startswith(PKG + "."):
                            add(mod, resolve(alias.name), kind)
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        pkg = base
                        for _ in range(child.level - 1):
                            pkg = pkg.rpartition(".")[0]
                        target = pkg + ("." + child.module if child.module else "")
                    else:
                        target = child.module or ""
                    if not (target == PKG or target.startswith(PKG + ".")):
                        continue
                    for alias in child.names:
                        sub = f"{target}.{alias.name}"
                        add(mod, sub if sub in mods else resolve(target), kind)
                visit(child, in_function or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
    return edges


def strongly_connected_components(nodes, succ) -> list[frozenset[str]]:
    """Tarjan's algorithm, iterative; only components of more than one node (no self-edges exist)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def module_level_cycles(src: Path = SRC) -> list[frozenset[str]]:
    mods = discover_modules(src)
    succ: dict[str, set[str]] = {}
    for (a, b), kinds in build_graph(mods).items():
        if "module" in kinds:
            succ.setdefault(a, set()).add(b)
    return [frozenset(_short(m) for m in c) for c in strongly_connected_components(mods, succ)]


def _fmt(cycle) -> str:
    return " <-> ".join(sorted(cycle))


# ----------------------------------------------------------------------------------------- tests


def test_graph_sees_both_kinds_of_import():
    """Sanity of the builder on edges that exist: ops -> kernels is function-level (Triton imported
    lazily), models.rmsnorm -> ops.norm module-level."""
    edges = build_graph(discover_modules())
    assert "module" in edges[("fastdecode.models.rmsnorm", "fastdecode.ops.norm")]
    assert edges[("fastdecode.ops.norm", "fastdecode.kernels.norm")] == {"function"}


def test_builder_finds_cycles_and_ignores_function_level(tmp_path):
    pkg = tmp_path / PKG
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("from .b import f\n")
    (pkg / "sub" / "b.py").write_text("import fastdecode.sub.a\n")
    (pkg / "c.py").write_text("def g():\n    from fastdecode.d import x\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fastdecode.c\n"
                              "from fastdecode import c\n")
    cycles = module_level_cycles(tmp_path)
    assert cycles == [frozenset({"sub.a", "sub.b"})]


def test_no_module_level_import_cycles():
    found = set(module_level_cycles())
    unexpected = [c for c in found if not any(c <= known for known in KNOWN_CYCLES)]
    stale = [k for k in KNOWN_CYCLES if not any(k <= c for c in found)]
    msgs = [f"new module-level import cycle: {_fmt(c)} (make one side a function-level import, or "
            f"move the shared code down a layer; see docs/architecture.md)" for c in unexpected]
    msgs += [f"KNOWN_CYCLES entry {_fmt(k)} ({KNOWN_CYCLES[k]}) no longer exists: delete it from "
             f"tests/test_import_graph.py" for k in stale]
    assert not msgs, "\n".join(msgs)


def test_no_long_modules():
    lengths = {_short(m): len(p.read_text(encoding="utf-8").splitlines())
               for m, (p, _) in discover_modules().items()}
    too_long = {m: n for m, n in lengths.items() if n > MAX_LINES}
    msgs = [f"{m}: {n} lines > {MAX_LINES}: split it" for m, n in sorted(too_long.items())
            if m not in KNOWN_LONG_MODULES]
    msgs += [f"KNOWN_LONG_MODULES entry {m} ({why}) is now {lengths.get(m, 'gone')} lines: delete it "
             f"from tests/test_import_graph.py" for m, why in KNOWN_LONG_MODULES.items() if m not in too_long]
    assert not msgs, "\n".join(msgs)

