"""The simulator's modules import each other one way: schedules (what every model reads) <- banks, l2 (the
shared-memory walks and the L2 model) <- strategies (simulate). Read from the source with ast, so a
function-level import that hides a cycle at import time is caught too."""
import ast
from pathlib import Path

import pytest

import cuflash.simulator

PACKAGE = "cuflash.simulator"
SOURCE = Path(cuflash.simulator.__file__).parent
MODULES = sorted(f.stem for f in SOURCE.glob("*.py"))


def sibling_imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported simulator module, line, is at module level) for every import of a sibling module."""
    tree = ast.parse((SOURCE / f"{module}.py").read_text())
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x, y
                names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif node.level == 0 and (node.module or "").startswith(PACKAGE + "."):
                names = [node.module[len(PACKAGE) + 1:].split(".")[0]]
            elif node.module == PACKAGE:  # from cuflash.simulator import banks
                names = [a.name for a in node.names]
            else:
                continue
        elif isinstance(node, ast.Import):
            names = [a.name[len(PACKAGE) + 1:].split(".")[0] for a in node.names if a.name.startswith(PACKAGE + ".")]
        else:
            continue
        out += [(n, node.lineno, id(node) in top) for n in names if n in MODULES and n != module]
    return out


GRAPH = {m: sorted({n for n, _, _ in sibling_imports(m)}) for m in MODULES}


def test_the_schedule_modules_are_there():
    assert {"schedules", "banks", "l2", "strategies"} <= set(MODULES), f"simulator modules: {MODULES}"


def test_simulator_imports_are_acyclic():
    state = dict.fromkeys(MODULES, "new")  # depth-first search: "open" while on the stack

    def visit(m, path):
        state[m] = "open"
        for n in GRAPH[m]:
            if state[n] == "open":
                cycle = path[path.index(n):] + [n]
                pytest.fail(f"simulator imports run in a circle: {' -> '.join(cycle)}")
            if state[n] == "new":
                visit(n, path + [n])
        state[m] = "done"

    for m in MODULES:
        if state[m] == "new":
            visit(m, [m])


@pytest.mark.parametrize("module,forbidden", [
    ("schedules", {"banks", "l2", "strategies", "execute", "validate", "cli"}),  # every model reads it
    ("banks", {"l2", "strategies", "execute", "validate", "cli"}),
    ("l2", {"banks", "strategies", "execute", "validate", "cli"}),
])
def test_lower_modules_do_not_import_the_models_above(module, forbidden):
    bad = sorted(set(GRAPH[module]) & forbidden)
    assert not bad, f"simulator/{module}.py imports {bad}; it may import only {sorted(set(GRAPH[module]) - forbidden)}"


@pytest.mark.parametrize("module", MODULES)
def test_sibling_imports_are_at_module_level(module):
    """A function-level import of a sibling is how a cycle hides (it only runs after both modules loaded)."""
    local = [f"{n} (line {line})" for n, line, at_top in sibling_imports(module) if not at_top]
    assert not local, f"simulator/{module}.py imports simulator modules inside functions: {', '.join(local)}"


def test_strategies_is_the_top():
    assert {"schedules", "banks", "l2"} <= set(GRAPH["strategies"]), f"strategies imports {GRAPH['strategies']}"
