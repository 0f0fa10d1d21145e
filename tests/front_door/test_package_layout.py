"""The package's import structure: no import cycles (imports deferred into functions included), no
module reaching into another module's private names, and the old module paths gone (CHANGELOG says
where each moved)."""
import ast
import importlib
import importlib.util
import pathlib

import pytest

import fedjax_sparse

PACKAGE = pathlib.Path(fedjax_sparse.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, str]]:
    """(imported module, imported name or '') for every import anywhere in the module, functions too;
    ``from pkg import mod`` counts as importing ``pkg.mod`` when that is a module."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full, "") if full in MODULES else (base, alias.name))
    return [(module, what) for module, what in found if module.startswith("fedjax_sparse")]


def _graph() -> dict[str, set[str]]:
    return {name: {m for m, _ in _imports(name) if m in MODULES and m != name} for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_even_through_deferred_imports():
    assert _cycles(_graph()) == []


def test_no_module_imports_another_modules_private_names():
    private = [(name, module, what) for name in MODULES for module, what in _imports(name)
               if what.startswith("_") and not what.startswith("__")]
    assert private == []


def test_no_module_reads_another_modules_private_attributes():
    # ``runner.open_run`` style: an attribute with one leading underscore read off an imported module.
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = {alias.asname or alias.name.split(".")[-1]
                   for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for alias in node.names
                   if (getattr(node, "module", None) or alias.name).startswith("fedjax_sparse")
                   or alias.name.startswith("fedjax_sparse")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append((name, f"{node.value.id}.{node.attr}"))
    assert found == []


@pytest.mark.parametrize("old", ["fedjax_sparse.masks", "fedjax_sparse.dropout", "fedjax_sparse.supermask",
                                 "fedjax_sparse.engine", "fedjax_sparse.training", "fedjax_sparse.evaluation",
                                 "fedjax_sparse.accounting", "fedjax_sparse.algorithms.base",
                                 "fedjax_sparse.models.spafl_models", "fedjax_sparse.models.feddrop_models",
                                 "fedjax_sparse.models.fsl_models", "fedjax_sparse.models.flax_adapter",
                                 "fedjax_sparse.models.macs", "fedjax_sparse.models.flax_probes",
                                 "fedjax_sparse.models.program_flow", *(f"fedjax_sparse.{name}" for name in (
                                     "config", "settings", "catalog", "experiment", "pinning", "privacy", "runner",
                                     "progress", "checkpoint", "sinks", "sweeps", "replicas", "population",
                                     "distributed", "memory", "bench", "programs", "timing", "reporting",
                                     "sidebyside", "studies")),
                                 *(f"fedjax_sparse.algorithms.{name}" for name in (
                                     "spafl", "feddrop", "fsl", "fedavg", "fedpm", "fjord", "heterofl")),
                                 "fedjax_sparse.data.partition"])
def test_the_old_module_paths_are_gone(old):
    # No file of this package answers the old path (another checkout's editable install on sys.path may).
    spec = importlib.util.find_spec(old)
    assert spec is None or not pathlib.Path(spec.origin).is_relative_to(PACKAGE), spec.origin


def test_every_import_of_the_package_names_one_of_its_modules():
    """A stale import (``from fedjax_sparse.runner import run``) names no module here, wherever else it resolves."""
    stale = [(name, module, what) for name in MODULES for module, what in _imports(name) if module not in MODULES]
    assert stale == []


# ------------------------------------------------------------------ the layers (issue 49 item 1)
# A module's layer: its first name below the package (``fedjax_sparse.core.engine`` -> ``core``); a module
# directly in the package is a layer of its own (``errors``, ``schema``, ``cli``). What each layer must not
# import, directly or through the modules it imports, imports deferred into functions included (the package's
# own ``__init__`` aside: its names load on first use).
FORBIDDEN = {
    "core": {"algorithms", "driver", "tools", "papers", "cli"},
    "mechanisms": {"algorithms", "data", "driver", "tools", "papers", "cli"},
    "algorithms": {"driver", "tools", "papers", "cli"},
    "models": {"algorithms", "driver", "tools", "papers", "cli"},
    "data": {"algorithms", "driver", "tools", "papers", "cli"},
    "driver": {"tools", "cli"},
    "errors": {"core", "mechanisms", "algorithms", "models", "data", "driver", "tools", "papers", "cli"},
    "schema": {"core", "mechanisms", "algorithms", "models", "data", "driver", "tools", "papers", "cli"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or not, with the chain of imports that reaches it."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        here = todo.pop()
        for there in sorted(graph[here] - {"fedjax_sparse"}):
            if there not in chains:
                chains[there] = chains[here] + [there]
                todo.append(there)
    return chains


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for name in sorted(graph):
        for reached, chain in _reachable(graph, name).items():
            if _layer(reached) in FORBIDDEN.get(_layer(name), ()):
                found.append(" -> ".join(chain))
    return found


def test_the_layers_are_what_the_package_says():
    for layer in ("core", "mechanisms", "algorithms", "models", "data", "driver", "tools", "papers"):
        assert (PACKAGE / layer / "__init__.py").is_file(), layer
    flat = sorted(name for name in MODULES if name.count(".") == 1 and not (PACKAGE / _layer(name)).is_dir())
    assert flat == ["fedjax_sparse.__main__", "fedjax_sparse.cli", "fedjax_sparse.errors", "fedjax_sparse.schema"]


def test_no_layer_imports_a_layer_above_it_even_through_deferred_imports():
    assert _layer_violations(_graph()) == []


def test_the_layer_check_finds_an_import_upwards_through_another_module():
    graph = {"fedjax_sparse.core.engine": {"fedjax_sparse.errors"},
             "fedjax_sparse.errors": {"fedjax_sparse.driver.settings"}, "fedjax_sparse.driver.settings": set()}
    assert _layer_violations(graph) == [
        "fedjax_sparse.core.engine -> fedjax_sparse.errors -> fedjax_sparse.driver.settings",
        "fedjax_sparse.errors -> fedjax_sparse.driver.settings"]


def test_the_papers_settings_export_every_public_name():
    import fedjax_sparse.papers.settings as settings
    public = {name for name in vars(settings) if not name.startswith("_") and name.isupper() or name == "setting"}
    assert public <= set(settings.__all__)


def test_no_name_of_a_package_takes_the_place_of_one_of_its_modules():
    """A package's attribute named as one of its modules is that module, once every module is imported: the
    generated builder ``fjs.algorithms.spafl`` took the place of the module ``algorithms/spafl.py`` (``import
    fedjax_sparse.algorithms.spafl as m`` gave the builder), the function ``fjs.data.partition`` that of
    ``data/partition.py``; the modules are now named for what they hold (``spafl_family``, ``partitions``)."""
    import sys
    for name in MODULES:
        if not name.endswith("__main__"):
            importlib.import_module(name)
    taken = []
    for name in MODULES:
        parent, _, child = name.rpartition(".")
        if parent and child != "__main__" and getattr(sys.modules[parent], child, None) is not sys.modules[name]:
            taken.append(f"{name}: {getattr(sys.modules[parent], child, None)!r}")
    assert taken == []
