"""fedjax_sparse.mechanisms: pure mechanism modules that import no engine types, used by the algorithms."""
import ast
import pathlib
import subprocess
import sys

import pytest

import fedjax_sparse.mechanisms as mechanisms

MECHANISMS_DIR = pathlib.Path(mechanisms.__file__).parent
MODULES = sorted(p.stem for p in MECHANISMS_DIR.glob("*.py") if p.stem != "__init__")
FORBIDDEN = ("fedjax_sparse.algorithms", "fedjax_sparse.core.engine", "fedjax_sparse.driver.runner", "fedjax_sparse.data")


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
    assert MODULES == ["attacks", "robust_aggregation", "supermask", "syncdrop", "threshold_masks", "widths"]
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


def test_algorithms_use_the_mechanisms():
    from fedjax_sparse.algorithms import feddrop_family as feddrop, fsl_family as fsl, spafl_family as spafl

    assert spafl.masks_lib is mechanisms.threshold_masks
    assert fsl.sm is mechanisms.supermask
    assert feddrop.SparseFlopsModel is mechanisms.syncdrop.SparseFlopsModel
