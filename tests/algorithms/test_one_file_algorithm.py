"""A new algorithm is one file (issue 49 item 3): the module that docs/design.md shows under "How to add an
algorithm in one file", written to a file of its own and imported, is in ``list`` with its description
and default lr, runs from ``run --algorithm`` and ``fjs.run`` with that lr, and nothing else is edited
(``catalog`` reads the registration)."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

import fedjax_sparse as fjs
from fedjax_sparse.algorithms import registry
from fedjax_sparse.cli import main

ROOT = Path(__file__).resolve().parents[2]
NAME = "fedavg_median"
TINY = ["--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--rounds", "2",
        "--local-epochs", "1", "--quiet"]


def design_example() -> str:
    """The python block of docs/design.md's section "How to add an algorithm in one file"."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("### How to add an algorithm in one file")[1].split("\n## ")[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def one_file(tmp_path):
    path = tmp_path / "my_algorithm.py"
    path.write_text(design_example())
    spec = importlib.util.spec_from_file_location("my_algorithm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["my_algorithm"] = module
    spec.loader.exec_module(module)
    yield module
    # The registry is process-wide: later tests list the package's algorithms only.
    registry._REGISTRY.pop(NAME, None)
    sys.modules.pop("my_algorithm", None)


def test_the_design_docs_algorithm_in_one_file_is_listed_and_runs_with_its_lr(one_file, tmp_path, capsys):
    from fedjax_sparse.driver import catalog
    line = "FedAvg with the coordinate-wise median of the client models (Yin et al., ICML 2018)"
    assert catalog.ALGORITHMS[NAME] == line and catalog.ALGORITHM_LR[NAME] == 0.05
    assert catalog.default_lr(NAME) == 0.05

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert f"  {NAME:<24} {line}\n" in out and "default --lr 0.05; options: momentum: float = 0.0" in out

    run_dir = tmp_path / "cli"
    assert main(["run", "--algorithm", NAME, "--option", "momentum=0.5", *TINY, "--out", str(run_dir)]) == 0
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["config"]["lr"] == 0.05 and recorded["algorithm_options"]["momentum"] == 0.5
    assert len([r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if "loss" in r]) == 2

    result = fjs.run(fjs.RunConfig(algorithm=NAME, dataset="digits", num_clients=6, clients_per_round=3, rounds=2,
                                   local_epochs=1), progress=False)
    assert result.config.lr == 0.05 and result.summary["algorithm"] == NAME


def test_its_server_takes_the_coordinate_wise_median(one_file):
    """The example's mechanism by hand: the median of three client models, coordinate by coordinate."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from helpers import make_task, tiny_federated
    alg = fjs.algorithms.make_algorithm(NAME, make_task(tiny_federated()[1]))
    messages = {"params": {"w": jnp.array([[1.0, 5.0], [3.0, -1.0], [2.0, 0.0]])}, "batch_stats": {}}
    ctx = fjs.algorithms.ServerContext(jnp.int32(0), jnp.arange(3), jnp.ones(3), jax.random.PRNGKey(0))
    new, _ = alg.server_update(one_file.MedianServerState({}), messages, ctx)
    np.testing.assert_array_equal(new.variables["params"]["w"], [2.0, 0.0])
