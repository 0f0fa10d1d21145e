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
