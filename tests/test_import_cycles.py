"""The package's modules import one another without cycles, so each layer can be read (and tested) on its own:
kernels below the model, the model below the engine, adapters on top.

Every `import` / `from ... import` statement of a module counts, at any depth: module level, inside functions,
and under `if TYPE_CHECKING:`. A lazy import inside a function still ties the two modules together (one cannot be
understood, moved or replaced without the other), so it may not close a cycle either. The graph is built from the
source with ast, nothing is imported. An edge goes to the module imported (`from .x import y` -> x, or x.y when y
is a submodule) and from a package's submodule to the package's `__init__` only where it imports that package."""
from __future__ import annotations

import ast
from pathlib import Path

import exl_backends

PACKAGE_DIR = Path(exl_backends.__file__).resolve().parent
PACKAGE = "exl_backends"


def module_name(path: Path) -> str:
    parts = (PACKAGE,) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def resolve(current: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a relative import `from <level dots><target> import ...` in module current."""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, is_package, node.level, node.module) if node.level else node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of g as a list of modules (the first repeated at the end), or None."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None
    for m in sorted(g):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_graph_sees_the_package():
    g = graph()
    assert "exl_backends.kernels.quant_matmul" in g
    assert "exl_backends.model.model" in g["exl_backends.model.runner"]       # a module-level relative import
    assert "exl_backends.kernels.quant_matmul" in g["exl_backends.model.linear"]    # one inside a function


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + " (move what both need into a lower module)"


def reached(g: dict[str, set[str]], m: str) -> set[str]:
    """Every module m imports, directly or through others."""
    seen, todo = set(), [m]
    while todo:
        for n in g[todo.pop()] - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_kernels_take_tensors_and_plain_values():
    """Kernel launchers reach (directly or not) nothing of the model above them (config, model, ops, ...): only each
    other, the CPU reference they must match, the error types, and the containers of what they compute on (packed
    weights: formats.exl2 / formats.gptq and tensors; the Batch of a forward pass)."""
    below = {"exl_backends.model.reference", "exl_backends.errors", "exl_backends.formats.tensors", "exl_backends.model.batch",
             "exl_backends.formats.exl2", "exl_backends.formats.gptq"}
    g = graph()
    for m in g:
        if m.startswith(f"{PACKAGE}.kernels"):
            above = {d for d in reached(g, m) if d not in below and not d.startswith(f"{PACKAGE}.kernels")}
            assert not above, f"{m} reaches {sorted(above)}"
