"""Layers import only downward: every import inside ``fbt_megatron/`` and ``data_pipeline/`` (found with
``ast``, also the ones inside functions) names a module of its own layer or a lower one.

The order (docs/architecture.md, "Layout"): a module's layer is that of the longest prefix below that
names it, except the root ``fbt_megatron``, which stands for the package's own ``__init__`` only (and the
names it defines): a module of ``fbt_megatron`` under no other entry has no layer, and fails this test
until its layer is declared. Imports within one layer are free; an import of a higher layer fails this
test with the file, the line and both layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fbt_megatron", "data_pipeline")

LAYERS = {
    # 1: runtime and configuration
    "fbt_megatron": 1,  # the package's __init__ only (version, runtime re-exports): see EXACT
    "fbt_megatron.runtime": 1,
    "fbt_megatron.logs": 1,
    "fbt_megatron.files": 1,
    "fbt_megatron.config": 1,
    # 2: the data pipeline, the recipe schema (it validates the data pipeline's section), the model (with
    # the feedback rule and the HF model class every export ships as remote code)
    "data_pipeline": 2,
    "fbt_megatron.recipe": 2,
    "fbt_megatron.errors": 2,  # the user-error root lives in data_pipeline.errors (layer 2), re-exported here
    "fbt_megatron.data": 2,
    "fbt_megatron.model": 2,
    "fbt_megatron.passes": 2,
    # 3: the DeepSpeed / Megatron engine glue
    "fbt_megatron.engine": 3,
    # 4: checkpoints, pipeline parallelism, and the run plan resolved from a recipe before launch
    "fbt_megatron.checkpoint": 4,
    "fbt_megatron.parallel": 4,
    "fbt_megatron.resolve": 4,
    # 5: training
    "fbt_megatron.train": 5,
    # 6: what uses a trained model or starts training (fbt train, fbt sft, SLURM)
    "fbt_megatron.generate": 6,
    "fbt_megatron.eval": 6,
    "fbt_megatron.hf": 6,
    "fbt_megatron.serving": 6,
    "fbt_megatron.launch": 6,
    "fbt_megatron.research": 6,
    "fbt_megatron.demo": 6,
    # 7: the `fbt` command (test support lives in tests/support, outside the packages)
    "fbt_megatron.cli": 7,
}


# entries that name one module, not its submodules: a new subpackage of fbt_megatron must declare its layer
EXACT = {"fbt_megatron"}
DECLARE = "declare its layer in LAYERS (tests/unit/test_layering.py; docs/architecture.md, \"Layout\")"


def _is_module(root: Path, parts: list[str]) -> bool:
    path = root.joinpath(*parts)
    return path.with_suffix(".py").is_file() or path.is_dir()


def layer_of(module: str, root: Path = ROOT) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            if prefix in EXACT and n < len(parts) and _is_module(root, parts[:n + 1]):
                return None  # a submodule under no entry of its own (not a name of the package's __init__)
            return LAYERS[prefix]
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported module) for every import of one of PACKAGES in ``path``; ``from x import y``
    counts as importing ``x.y`` (a submodule or a name of ``x``: the longest layer prefix decides)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            out += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base) for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] in PACKAGES]


def upward_imports(root: Path = ROOT) -> list[str]:
    problems = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name_here = module_name(path, root)
            mine = layer_of(name_here, root)
            if mine is None:
                problems.append(f"{path.relative_to(root)}: no layer declared for {name_here}: {DECLARE}")
                continue
            for line, name in imports(path, root):
                theirs = layer_of(name, root)
                if theirs is None:
                    problems.append(f"{path.relative_to(root)}:{line}: imports {name}, which has no layer: "
                                    f"{DECLARE}")
                elif theirs > mine:
                    problems.append(f"{path.relative_to(root)}:{line}: {name_here} (layer {mine}) "
                                    f"imports {name} (layer {theirs})")
    return problems


def test_no_module_imports_a_higher_layer():
    problems = upward_imports()
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_the_walk_sees_imports_inside_functions_and_relative_ones(tmp_path):
    pkg = tmp_path / "fbt_megatron"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "x.py").write_text("def f():\n    from ..train import run\n\nfrom . import y\n")
    (pkg / "model" / "y.py").write_text("import fbt_megatron.config\n")
    (tmp_path / "data_pipeline").mkdir()
    problems = upward_imports(tmp_path)
    assert problems == [
        "fbt_megatron/model/x.py:2: fbt_megatron.model.x (layer 2) imports fbt_megatron.train.run (layer 5)"]


def test_an_undeclared_subpackage_has_no_layer(tmp_path):
    pkg = tmp_path / "fbt_megatron"
    (pkg / "newthing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "runtime.py").write_text("from fbt_megatron import __version__\n")
    (pkg / "newthing" / "__init__.py").write_text("")
    (pkg / "newthing" / "x.py").write_text("")
    (tmp_path / "data_pipeline").mkdir()
    problems = upward_imports(tmp_path)
    assert problems == [f"fbt_megatron/newthing/__init__.py: no layer declared for fbt_megatron.newthing: {DECLARE}",
                        f"fbt_megatron/newthing/x.py: no layer declared for fbt_megatron.newthing.x: {DECLARE}"]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of PACKAGES it imports (anywhere in the file). A package's ``__init__`` is the
    package's name: a submodule that imports a name its own package's ``__init__`` defines (``from . import
    name``, ``from fbt_megatron import __version__``) depends on that ``__init__``, so a cycle through it
    (the ``__init__`` importing the submodule back) is one."""
    modules = {module_name(path, root): path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}

    def resolve(name: str) -> str | None:  # the longest prefix that is a module (``from x import name``)
        parts = name.split(".")
        return next((m for n in range(len(parts), 0, -1) if (m := ".".join(parts[:n])) in modules), None)

    graph = {}
    for module, path in modules.items():
        targets = {resolve(name) for _, name in imports(path, root)}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted(component + [v]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    """No two modules import each other, directly or round a loop, also through imports inside functions
    (a lazy import hides a cycle from Python, not from a reader)."""
    assert import_cycles(import_graph()) == []


def test_import_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_a_cycle_through_a_packages_own_init_is_found(tmp_path):
    pkg = tmp_path / "fbt_megatron"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model" / "__init__.py").write_text("from .layers import Layer\n\nSIZE = 4\n")
    (pkg / "model" / "layers.py").write_text("from . import SIZE\n\n\nclass Layer:\n    size = SIZE\n")
    (pkg / "model" / "other.py").write_text("import fbt_megatron.model.layers\n")  # a submodule through its package
    (tmp_path / "data_pipeline").mkdir()
    assert import_cycles(import_graph(tmp_path)) == [["fbt_megatron.model", "fbt_megatron.model.layers"]]


def lower_modules_in_higher_packages() -> list[tuple[str, str]]:
    """(module, package) for each module declared below the layer of a package that holds it (importing
    the module would run that package's ``__init__`` first, with its layer's imports)."""
    out = []
    for name, layer in LAYERS.items():
        parts = name.split(".")
        for n in range(len(parts) - 1, 0, -1):
            package = ".".join(parts[:n])
            if (layer_of(package) or 0) > layer:
                out.append((name, package))
    return out


def test_every_folder_sits_in_one_layer():
    """No module is declared below its folder's layer: a reader who opens a folder sees one layer (the
    feedback rule lives in model/, which every HF export copies it from)."""
    assert lower_modules_in_higher_packages() == []
    assert not [name for name in LAYERS if name.startswith(("fbt_megatron.hf.", "data_pipeline."))]


def test_a_lower_module_in_a_higher_folder_is_found(monkeypatch):
    monkeypatch.setitem(LAYERS, "fbt_megatron.hf.feedback_rule", 2)
    assert lower_modules_in_higher_packages() == [("fbt_megatron.hf.feedback_rule", "fbt_megatron.hf")]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the folders its modules import (a module directly under a package root is its own
    folder): the house drawn folder by folder."""
    def folder(module: str) -> str:
        parts = module.split(".")
        here = ROOT.joinpath(*parts[:2])
        return ".".join(parts[:2]) if len(parts) > 1 and here.is_dir() else module

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            if folder(module) != folder(target):
                out.setdefault(folder(module), set()).add(folder(target))
    return out


def test_no_two_folders_import_each_other():
    """Drawn folder by folder, every import runs one way (the model's folder imports nothing of hf/)."""
    assert import_cycles(folder_graph(import_graph())) == []
