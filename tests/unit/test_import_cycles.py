"""No import cycles among `runtime/` modules: read from the code's own import statements (every one,
including those inside functions and under `if TYPE_CHECKING:`), so a cycle that Python happens to
tolerate at run time, or that only a type checker follows, still fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_files() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "runtime").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The runtime modules `name` imports: `import a.b`, `from a import b` (b a module, or a name in a),
    relative forms resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return (found & modules.keys()) - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_sees_type_only_and_function_level_imports(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.b import B\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from runtime import a\n")
    modules = {"runtime.a": a, "runtime.b": b}
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    assert cycles(graph) == [["runtime.a", "runtime.b"]]


def test_runtime_has_no_import_cycles():
    modules = module_files()
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    assert cycles(graph) == []
