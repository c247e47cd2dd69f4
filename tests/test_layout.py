"""The library's layout holds: modules of one concept, no import cycle, layers importing downwards, public names
across modules.

The layers (DESIGN.md): what needs no process group at the bottom (the degrees, the analytical models of
``labkit.costmodel``, pure arithmetic, and the workloads they describe: ``models``, ``data``, schedules as data),
then the runtime (dist, the ``launch`` package, mesh, trace, collectives, measure), then the parallelisms
(``labkit.parallel``), then the training recipes (lr, precision, recompute, the ``checkpoint`` package, loader,
monitor, pitfalls); the ``train`` package, the course's tools and the command line on top.  A module may
import from its own layer and the layers below, never from above.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

LIBRARY = REPO / "labkit"
# A module holds one concept and may be long when its subject is (DESIGN.md).  Past LONG_LINES it is listed in
# LONG_MODULES with the reason its subject needs the room, so that a module growing long is a decision someone read,
# not an accident; past MAX_LINES it is split by concept (never into prefix-named siblings).
LONG_LINES = 420
MAX_LINES = 600
LONG_MODULES: dict[str, str] = {
    "labkit.launch.launcher": "one launch's life, start to results or to a named failure, reads as one story",
    "labkit.grading.checkers.parameter_server": "exercise 08's checks: the rule by hand on many cases, then on ranks",
    "labkit.fake_world": "two 1,024-GPU layouts built by PyTorch and each term beside the model, every difference "
                         "computed: one check read top to bottom",
}
LAYERS = [  # lowest first; a module's layer is the first prefix that matches
    # The pipeline's schedules and their simulator are tables and arithmetic, no process group: analytical
    # models (the 3D step model prices a schedule with them), kept beside the runtime that runs the same tables;
    # so is context parallelism's layout (which tokens a rank holds, the causal work of each tile), and the MoE layer
    # that TinyGPT's blocks hold (router, permutation, layer: one process; expert parallelism is a layer above).
    ("workloads and models", ("labkit.degrees", "labkit.costmodel", "labkit.data", "labkit.models", "labkit.parallel.pipeline.schedule",
                              "labkit.parallel.pipeline.zero_bubble", "labkit.parallel.pipeline.catalog",
                              "labkit.parallel.pipeline.engine",
                              "labkit.parallel.pipeline.simulate", "labkit.parallel.context.sequence",
                              "labkit.parallel.experts.router", "labkit.parallel.experts.permute",
                              "labkit.parallel.experts.layer")),
    ("runtime", ("labkit.dist", "labkit.launch", "labkit.mesh", "labkit.trace", "labkit.collectives",
                 "labkit.measure", "labkit.calibrate", "labkit.claims", "labkit.fake_world")),
    ("parallel", ("labkit.parallel",)),
    ("recipes", ("labkit.lr", "labkit.precision", "labkit.recompute", "labkit.checkpoint", "labkit.loader",
                 "labkit.monitor", "labkit.pitfalls")),
    ("top", ("labkit.train", "labkit.viz", "labkit.grading", "labkit.cli", "labkit")),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in LIBRARY.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The labkit modules ``path`` imports at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("labkit"):
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(_modules())
            found.update(submodules or {node.module})  # `from labkit import dist` imports labkit.dist
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("labkit"))
    modules = _modules()
    return {name for name in found if name in modules}


def _layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer of tests/test_layout.py")


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_module_runs_past_the_hard_limit(module):
    lines = len(_modules()[module].read_text().splitlines())
    assert lines <= MAX_LINES, (f"{module} has {lines} lines; split it by concept (DESIGN.md: a folder per "
                                "technique, the same file name for the same thing in every folder)")


def test_every_long_module_is_listed_with_its_reason():
    long = {module for module, path in _modules().items() if len(path.read_text().splitlines()) > LONG_LINES}
    assert long <= set(LONG_MODULES), (f"over {LONG_LINES} lines and not in LONG_MODULES: {sorted(long - set(LONG_MODULES))}: "
                                       "split it by concept, or list it with the reason its subject needs the room")
    assert set(LONG_MODULES) <= long, f"listed as long but no longer: {sorted(set(LONG_MODULES) - long)}"


def test_no_module_imports_from_a_layer_above_its_own():
    offences = [f"{module} ({LAYERS[_layer(module)][0]}) imports {imported} ({LAYERS[_layer(imported)][0]})"
                for module, path in _modules().items() for imported in _imports(path)
                if _layer(imported) > _layer(module)]
    assert not offences, "\n".join(offences)


def test_there_is_no_import_cycle():
    graph = {module: {i for i in _imports(path) if i != module and not module.startswith(i + ".")}
             for module, path in _modules().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                cycle = path[path.index(imported):] + [imported] if imported in path else [module, imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, path + [imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _private_reaches(path: Path) -> list[str]:
    """``from labkit.x import _name`` and ``module._name`` where ``module`` is a labkit module imported by name."""
    tree = ast.parse(path.read_text())
    modules, found = _modules(), []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("labkit"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                if f"{node.module}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            aliases.update({alias.asname or alias.name: alias.name for alias in node.names
                            if alias.name.startswith("labkit")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    return found


@pytest.mark.parametrize("module", sorted(_modules()))
def test_no_module_reaches_another_modules_private_names(module):
    """A name another module needs is public where it is defined (or the code moves to where it is used)."""
    assert not _private_reaches(_modules()[module]), _private_reaches(_modules()[module])


PRIVATE = re.compile(r"from labkit[\w.]* import [^\n]*\b_\w+|\blabkit(?:\.\w+)*\._\w+|\b(?:plots|widgets|lr|measure|"
                     r"memory|costs|compute|step_model|recompute|precision|data|trace|grading)\._[a-z]\w*")


@pytest.mark.parametrize("notebook", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebooks_import_only_public_names(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    assert not PRIVATE.findall(code), f"{notebook.name} reaches private names: {PRIVATE.findall(code)}"
