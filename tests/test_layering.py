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
    ("shardc.hardware", "shardc.plan", "shardc.frontend"),     # clusters; plans; tracing and specs
    ("shardc.cost",),                                          # the analytical model
    ("shardc.search",),                                        # the solver
    ("shardc.passmanager", "shardc.passes"),                   # passes over the IR
    ("shardc.backends",),                                      # torch codegen and runtime
    ("shardc.calibration",),                                   # the local profile, GPU calibration
    ("shardc.driver", "shardc.api"),                           # one front door
    ("shardc.train",),                                         # the training loop and memory tracker
    ("shardc.run", "shardc.study"),                            # training on local processes
    ("shardc.cli", "shardc"),                                  # the command line; the package root
]

# Imports against the grain that the refactor of issue 12 is removing. The list only shrinks: a
# new violation fails, and so does a listed one that is gone (delete its line here).
KNOWN: set[str] = {
    'backends/torch/launch.py: shardc.backends.torch.launch (layer shardc.backends) imports shardc.api (higher layer shardc.api)',
    'compiler/calibration/gpu.py: shardc.calibration.gpu (layer shardc.calibration) imports shardc.study.gpu_report (higher layer shardc.study)',
    'compiler/hardware.py: shardc.hardware (layer shardc.hardware) imports shardc.calibration.local (higher layer shardc.calibration)',
    'compiler/ops/builtin.py: shardc.ops.builtin (layer shardc.ops) imports shardc.frontend.rules (higher layer shardc.frontend)',
    'compiler/study/sweep.py: imports the package root `shardc`; import the module',
}
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


def violations() -> list[str]:
    out = []
    for module, path in sorted(MODULES.items()):
        layer, entry = _owner(module)
        for target, line in _imports(module, path):
            if target == "shardc" and module != "shardc":
                out.append(f"{path.relative_to(ROOT)}:{line}: imports the package root `shardc`; import the module")
                continue
            t_layer, t_entry = _owner(target)
            if t_entry == entry or (entry, t_entry) in SAME_UNIT:
                continue
            if t_layer > layer:
                out.append(f"{path.relative_to(ROOT)}:{line}: {module} (layer {entry}) imports {target} "
                           f"(higher layer {t_entry})")
            elif t_layer == layer:
                out.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {target}: {entry} and {t_entry} "
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


# Import cycles being removed (the list only shrinks, as KNOWN).
KNOWN_CYCLES: set[str] = {
    'shardc.calibration.gloo <-> shardc.calibration.local <-> shardc.calibration.ops <-> shardc.cost.compute <-> shardc.hardware',
    'shardc.calibration.gpu <-> shardc.study.gpu_report',
    'shardc.frontend.creation <-> shardc.frontend.emit <-> shardc.frontend.normalize <-> shardc.frontend.rules <-> shardc.frontend.views <-> shardc.ops.builtin',
    'shardc.frontend.onnx <-> shardc.frontend.onnx_ops',
}


def test_no_import_cycles() -> None:
    found = set(cycles())
    assert not found - KNOWN_CYCLES, "modules that import each other:\n" + "\n".join(sorted(found - KNOWN_CYCLES))
    assert not KNOWN_CYCLES - found, "fixed, so delete from KNOWN_CYCLES:\n" + "\n".join(sorted(KNOWN_CYCLES - found))


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _owner(module)


def _key(line: str) -> str:
    """A violation without its line number, so edits above it do not move it."""
    path, _, rest = line.partition(":")
    return path + ":" + rest.partition(":")[2]


def test_imports_follow_the_layers() -> None:
    found = {_key(v) for v in violations()}
    new = sorted(found - KNOWN)
    assert not new, "imports against the layering (tests/test_layering.py):\n" + "\n".join(new)
    fixed = sorted(KNOWN - found)
    assert not fixed, "fixed, so delete from KNOWN in tests/test_layering.py:\n" + "\n".join(fixed)


def test_the_check_can_fail() -> None:
    """The rule itself: the registry importing the cost model would be reported."""
    assert _owner("shardc.ops.registry")[0] < _owner("shardc.cost.model")[0]
    assert _owner("shardc.backends.torch.launch")[1] == "shardc.backends"


if __name__ == "__main__":
    print("\n".join(sorted({_key(v) for v in violations()})))
    print("cycles:\n" + "\n".join(cycles()))
