"""The exploration notebook runs top to bottom (its code cells, in order)."""
import json
from pathlib import Path

import pytest

import matplotlib

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "explore.ipynb"


@pytest.mark.slow  # the four per-system notebooks (tests/end_to_end/test_notebooks.py) run by default; this older tour is slow
def test_explore_notebook_executes():
    matplotlib.use("Agg")
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    namespace = {}
    for cell in cells:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}", "exec"), namespace)
    assert namespace["curves"] and "fedavg" in namespace["curves"]
    assert namespace["ev"]["accuracy"] > 0.3
