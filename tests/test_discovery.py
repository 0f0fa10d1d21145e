"""Discovery and small consistencies (issue 42 item 6): one version everywhere, ``run --help`` in
argument groups with examples, ``list`` describing each algorithm and model, the docs opening with a
copyable example, ``report`` naming the density it shows."""
import re
from importlib.metadata import version
from pathlib import Path

import pytest

import fedjax_sparse as fjs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fast
def test_one_version_in_the_package_its_metadata_pyproject_and_the_changelog():
    declared = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    top = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert fjs.__version__ == version("fedjax_sparse") == declared == top


@pytest.mark.fast
def test_report_shows_and_names_the_density_the_runs_own_table_shows(tmp_path):
    """The issue's case: report showed 0.695 (over all clients) where the run printed 0.679 (sampled)."""
    from fedjax_sparse.progress import format_summary
    from helpers import fake_run
    row = {"round": 5, "accuracy": 0.5, "density": 0.679, "density_all_clients": 0.695}
    run = fake_run(tmp_path / "spafl", {"algorithm": "spafl", "rounds": 5}, [row])
    table = fjs.report_table([run])
    header, _, line = table.splitlines()
    assert "density (sampled clients)" in header and "0.679" in line and "0.695" not in line, table
    summary = {"algorithm": "spafl", "dataset": "d", "model": "m", "rounds": 5, "final_accuracy": 0.5,
               "final_accuracy_std": None, "final_global_accuracy": None, "best_accuracy": 0.5, "best_round": 5,
               "final_density": 0.679, "total_gbit": None, "total_flops": None, "seconds": 1.0,
               "first_chunk_seconds_incl_compile": 1.0}
    assert "density (sampled clients)" in format_summary(summary) and "0.679" in format_summary(summary)
