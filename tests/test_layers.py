"""The layers a fork can see, checked from the code's own imports (syntax trees, nothing imported).

    errors        the ground floor: imports nothing of torchpar's
    config/       imports only errors
    the runtime   models, parallel, data, checkpoint, the trainer and what it runs
    the top       plan/, tools/, selftest, verify and commands/ (argv, main, exit codes)

An arrow only points down; the runtime never imports the top; there is no import loop; and no
torchpar import hides inside a function (where it would dodge a loop) outside the command modules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from harness import ROOT

PACKAGE = ROOT / "torchpar"
TOP = ("torchpar.plan", "torchpar.tools", "torchpar.selftest", "torchpar.verify", "torchpar.commands",
       "torchpar.__main__")
# torchpar imports allowed inside a function, each with its reason (empty: none is needed today).
INSIDE_FUNCTIONS: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def imports_in(source: str) -> list[tuple[str, int, bool]]:
    """(imported torchpar module, line, inside a function) for every import of a file's ``source``;
    ``from a import b`` names the module a.b when b is one."""
    tree = ast.parse(source)
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(sub) for sub in ast.walk(node) if sub is not node)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                       for a in node.names]
        else:
            continue
        found += [(t, node.lineno, id(node) in inside) for t in targets if under(t, "torchpar")]
    return found


@functools.cache
def main_graph() -> dict[str, list[tuple[str, int, bool]]]:
    """The package's import graph as it is (parsed once; a test that adds an edge copies it)."""
    return graph(MODULES)


def graph(modules: dict[str, Path]) -> dict[str, list[tuple[str, int, bool]]]:
    return {name: imports_in(path.read_text()) for name, path in modules.items()}


def problems(edges: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """Every import that breaks a rule, and every loop, as a line naming the file and the line."""
    out = []
    for src, targets in edges.items():
        where = f"{MODULES[src].relative_to(ROOT)}"
        for dst, line, in_function in targets:
            if src == "torchpar.errors":
                out.append(f"{where}:{line}: the ground floor imports {dst}")
            if under(src, "torchpar.config") and not under(dst, "torchpar.config", "torchpar.errors"):
                out.append(f"{where}:{line}: config/ imports {dst} (it may import only torchpar.errors)")
            if not under(src, *TOP) and under(dst, *TOP):
                out.append(f"{where}:{line}: the runtime imports {dst}, a module of the top floor")
            if under(dst, "torchpar.commands", "torchpar.__main__") and not under(src, "torchpar.commands",
                                                                                   "torchpar.__main__"):
                out.append(f"{where}:{line}: {src} imports the commands")
            if under(src, "torchpar.plan") and under(dst, "torchpar.train", "torchpar.verify",
                                                     "torchpar.selftest"):
                out.append(f"{where}:{line}: the planner imports {dst} (it predicts; verify measures)")
            if (in_function and not under(src, "torchpar.commands")
                    and (src, dst) not in INSIDE_FUNCTIONS):
                out.append(f"{where}:{line}: {dst} imported inside a function")
    out += [f"import loop: {' -> '.join(loop)}" for loop in loops(edges)]
    return out


def loops(edges: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), over every import."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in edges.get(v, []):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_breaks_a_layer():
    found = problems(main_graph())
    assert not found, "\n".join(found)


def test_model_code_imports_nothing_distributed():
    """Parallelism is applied from outside: the model files never reach torch.distributed."""
    bad = []
    for name, path in MODULES.items():
        if under(name, "torchpar.models"):
            for node in ast.walk(ast.parse(path.read_text())):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                        [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in mods
                        if under(m, "torch.distributed", "torchpar.parallel")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, line, expected", [
    ("torchpar/train.py", "from torchpar.plan import predict_for_trainer",
     "the runtime imports torchpar.plan"),
    ("torchpar/config/load.py", "from torchpar.models import MODELS", "config/ imports torchpar.models"),
    ("torchpar/errors.py", "from torchpar import console", "the ground floor imports torchpar.console"),
    ("torchpar/device.py", "def f():\n    from torchpar import metrics", "imported inside a function"),
    ("torchpar/plan/estimate.py", "from torchpar.train import Trainer", "the planner imports torchpar.train"),
    ("torchpar/console.py", "from torchpar import train", "import loop"),
])
def test_a_deliberate_upward_import_is_caught(source, line, expected):
    """The checker on main plus one added line: the line breaks the rule it names."""
    edges = dict(main_graph())
    name = module_name(ROOT / source)
    edges[name] = edges[name] + imports_in(line)
    found = problems(edges)
    assert any(expected in p for p in found), found
