"""The layering contract: `shardc` is layered, and every import (top-level or inside a function)
goes to the module's own package or to a lower layer.

Lowest first. Packages in one layer are independent of each other. A newcomer reads the table
to know where a concept lives and what it may use; a change that imports against the grain
fails here with the offending line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"compiler": "shardc", "passes": "shardc.passes", "backends": "shardc.backends"}

LAYERS: list[tuple[str, ...]] = [
    ("shardc.ir",),                                            # types, graph, printer, parser, errors
    ("shardc.ops",),                                           # the op registry and its rules
    ("shardc.analysis",),                                      # dim roles, layouts, resharding
    ("shardc.calibration.profile",),                           # the local profile: measured data, its file
    ("shardc.hardware", "shardc.plan", "shardc.frontend"),     # clusters; plans; tracing and specs
    ("shardc.cost",),                                          # the analytical model
    ("shardc.search",),                                        # the solver
    ("shardc.passmanager", "shardc.passes"),                   # passes over the IR
    ("shardc.backends",),                                      # torch codegen and runtime
    ("shardc.calibration",),                                   # measuring the local profile, GPU calibration
    ("shardc.driver", "shardc.api"),                           # one front door
    ("shardc.train",),                                         # the training loop and memory tracker
    ("shardc.run", "shardc.study"),                            # training on local processes
    ("shardc.cli", "shardc"),                                  # the command line; the package root
]

# Inside one layer these packages form one unit (the pass manager discovers the passes).
SAME_UNIT = {("shardc.passmanager", "shardc.passes"), ("shardc.passes", "shardc.passmanager"),
             ("shardc.driver", "shardc.api"), ("shardc.api", "shardc.driver")}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _owner(module: str) -> tuple[int, str]:
    """The layer index and the layer entry (longest matching prefix) a module belongs to."""
    best: tuple[int, str] | None = None
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (index, entry)
    assert best is not None, f"{module} is in no layer of tests/test_layering.py; add it to LAYERS"
    return best


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "shardc"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "shardc":
                continue
            names = [f"{base}.{a.name}" for a in node.names]
            found += [(n, node.lineno) for n in names if n in MODULES] or [(base, node.lineno)]
    return found


MODULES = _modules()


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def violations(modules: dict[str, Path] | None = None) -> list[str]:
    """Every import against the layering, as `path:line: what`."""
    out = []
    for module, path in sorted((modules or MODULES).items()):
        layer, entry = _owner(module)
        for target, line in _imports(module, path):
            if target == "shardc" and module != "shardc":
                out.append(f"{_shown(path)}:{line}: imports the package root `shardc`; import the module")
                continue
            t_layer, t_entry = _owner(target)
            if t_entry == entry or (entry, t_entry) in SAME_UNIT:
                continue
            if t_layer > layer:
                out.append(f"{_shown(path)}:{line}: {module} (layer {entry}) imports {target} "
                           f"(higher layer {t_entry})")
            elif t_layer == layer:
                out.append(f"{_shown(path)}:{line}: {module} imports {target}: {entry} and {t_entry} "
                           "share a layer and stay independent")
    return out


def cycles() -> list[str]:
    """Modules that import each other, directly or round a longer loop (Tarjan's components)."""
    # A package's `__init__` re-exporting its own modules is not a cycle.
    graph = {m: {t for t, _ in _imports(m, p) if t in MODULES and t != m
                 and not (p.name == "__init__.py" and t.startswith(m + "."))} for m, p in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[str] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in sorted(graph[m]):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                t = stack.pop()
                component.append(t)
                if t == m:
                    break
            if len(component) > 1:
                out.append(" <-> ".join(sorted(component)))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(out)


def test_no_import_cycles() -> None:
    found = cycles()
    assert not found, "modules that import each other:\n" + "\n".join(found)


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _owner(module)


def test_imports_follow_the_layers() -> None:
    found = violations()
    assert not found, "imports against the layering (tests/test_layering.py):\n" + "\n".join(found)


def test_the_check_can_fail(tmp_path: Path) -> None:
    """The rule itself: an op module importing the cost model, or a pass importing the driver,
    is reported with its line."""
    upward = tmp_path / "upward.py"
    upward.write_text("import torch\n\n\ndef f():\n    from shardc.cost.model import estimate\n    return estimate\n")
    sideways = tmp_path / "sideways.py"
    sideways.write_text("from shardc.driver import partition\n")
    found = violations({"shardc.ops.upward": upward, "shardc.passes.sideways": sideways})
    assert len(found) == 2
    assert "upward.py:5: shardc.ops.upward (layer shardc.ops) imports shardc.cost.model" in found[0]
    assert "sideways.py:1: shardc.passes.sideways (layer shardc.passes) imports shardc.driver" in found[1]


if __name__ == "__main__":
    print("\n".join(violations()))
    print("cycles:\n" + "\n".join(cycles()))
