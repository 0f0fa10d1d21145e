"""fedjax_sparse.mechanisms: pure mechanism modules that import no engine types, and
the old import paths still give the very same objects."""
import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import fedjax_sparse.mechanisms as mechanisms

MECHANISMS_DIR = pathlib.Path(mechanisms.__file__).parent
MODULES = sorted(p.stem for p in MECHANISMS_DIR.glob("*.py") if p.stem != "__init__")
FORBIDDEN = ("fedjax_sparse.algorithms", "fedjax_sparse.engine", "fedjax_sparse.runner", "fedjax_sparse.data")


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module an ``import`` / ``from ... import`` anywhere in the file names
    (``from pkg import name`` counts as both ``pkg`` and ``pkg.name``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_the_package_lists_its_modules():
    assert MODULES == ["attacks", "robust_aggregation", "supermask", "syncdrop", "threshold_masks"]
    assert sorted(mechanisms.__all__) == MODULES
    for name in MODULES:
        assert f"``{name}``" in mechanisms.__doc__


@pytest.mark.parametrize("path", sorted(MECHANISMS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_mechanisms_import_no_engine_types(path):
    bad = sorted(name for name in _imported_modules(path) if _forbidden(name))
    assert not bad, f"{path.name} imports {bad}"


def test_importing_mechanisms_loads_no_engine_module():
    # Transitively too: a fresh interpreter that imports every mechanism module
    # must not have loaded any algorithms / engine / runner / data module.
    code = ("import sys, fedjax_sparse.mechanisms; "
            "print('\\n'.join(m for m in sys.modules if m.startswith('fedjax_sparse')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(mechanisms.__file__).parents[2]).stdout.split()
    assert "fedjax_sparse.mechanisms.attacks" in out
    assert not [m for m in out if _forbidden(m)], out


# (old module, new mechanisms module, names that must be the same objects; None: all of __all__)
OLD_PATHS = [
    ("fedjax_sparse.masks", "threshold_masks", None),
    ("fedjax_sparse.dropout", "syncdrop", None),
    ("fedjax_sparse.supermask", "supermask", None),
    ("fedjax_sparse.algorithms.robust", "robust_aggregation", [
        "masked_mean", "_keys_to_floats", "sort_rows", "trimmed_mean", "pairwise_sq_distances",
        "multi_krum_select", "krum_count", "multi_krum", "sign_majority", "topk_sparsify"]),
    ("fedjax_sparse.algorithms.robust", "attacks", [
        "DEVIATIONS", "malicious_clients", "deviation", "halving_search", "min_max_attack",
        "_trimmed_mean_with_copies", "tailored_trimmed_mean_attack", "tailored_multi_krum_attack",
        "sign_reverse_attack"]),
    ("fedjax_sparse.algorithms.robust", "supermask", ["order_keys", "kept_count"]),
    ("fedjax_sparse.algorithms.fsl", "attacks", ["reverse_attack"]),
]


@pytest.mark.parametrize("old, new, names", OLD_PATHS, ids=[f"{o}->{n}" for o, n, _ in OLD_PATHS])
def test_old_import_paths_give_the_same_objects(old, new, names):
    old_module = importlib.import_module(old)
    new_module = importlib.import_module(f"fedjax_sparse.mechanisms.{new}")
    if names is None:   # a whole module moved: the same public names, the same objects
        names = list(new_module.__all__)
        assert list(old_module.__all__) == names
    for name in names:
        obj = getattr(new_module, name)
        assert getattr(old_module, name) is obj, f"{old}.{name}"
        if callable(obj):   # defined in the mechanisms module, not just passed through it
            assert obj.__module__ == new_module.__name__, f"{name} defined in {obj.__module__}"


def test_whole_module_shims_export_every_public_name():
    for old, new in (("masks", "threshold_masks"), ("dropout", "syncdrop"), ("supermask", "supermask")):
        new_module = importlib.import_module(f"fedjax_sparse.mechanisms.{new}")
        defined = {n for n, v in vars(new_module).items()
                   if not n.startswith("_") and getattr(v, "__module__", new_module.__name__) == new_module.__name__
                   and not isinstance(v, type(sys))}
        assert defined <= set(new_module.__all__), (new, sorted(defined - set(new_module.__all__)))
        namespace: dict = {}
        exec(f"from fedjax_sparse.{old} import *", namespace)
        assert {n for n in namespace if n != "__builtins__"} == set(new_module.__all__)


def test_algorithms_use_the_mechanisms():
    import importlib
    from fedjax_sparse.algorithms import robust
    # The package attributes feddrop, fsl, spafl are the builder functions; the modules by path:
    feddrop, fsl, spafl = (importlib.import_module(f"fedjax_sparse.algorithms.{m}") for m in ("feddrop", "fsl", "spafl"))

    assert spafl.masks_lib is mechanisms.threshold_masks
    assert fsl.sm is mechanisms.supermask
    assert feddrop.SparseFlopsModel is mechanisms.syncdrop.SparseFlopsModel
    assert robust.trimmed_mean is mechanisms.robust_aggregation.trimmed_mean
