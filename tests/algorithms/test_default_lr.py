"""Defaults that train (issue 42 item 5): with no learning rate given, every algorithm takes its own
default (``fedjax_sparse.driver.catalog.ALGORITHM_LR``), recorded in config.json. That every algorithm then
trains the embedded digits and the built-in image data sets with finite loss is checked with the other
every-algorithm checks, in tests/algorithms/test_every_algorithm.py."""
import json

import fedjax_sparse as fjs
from fedjax_sparse.driver.catalog import DEFAULT_LR, default_lr

from helpers import TINY_RUN as TINY, finite_losses


def test_an_unset_learning_rate_is_the_algorithms_default_and_recorded(tmp_path):
    """The cheap variant of the every-algorithm matrices: the default is resolved, used and recorded (SpaFL's changed:
    0.1 diverged on Fashion-MNIST)."""
    assert fjs.RunConfig().lr is None
    assert default_lr("spafl") == 0.01 and default_lr("fedavg") == DEFAULT_LR == 0.1
    assert fjs.build(fjs.RunConfig(algorithm="spafl", **TINY)).task.lr == 0.01
    assert fjs.build(fjs.RunConfig(algorithm="spafl", lr=0.3, **TINY)).task.lr == 0.3   # given: used
    out = tmp_path / "fedavg"
    result = fjs.run(fjs.RunConfig(algorithm="fedavg", dataset="digits", **{**TINY, "num_clients": 8}, out=str(out)),
                     progress=False)
    assert result.config.lr == 0.1 and finite_losses(result)
    assert json.loads((out / "config.json").read_text())["config"]["lr"] == 0.1
    # The CLI alike: no --lr leaves it unset (the algorithm's), not 0.1.
    from fedjax_sparse.cli import _parser, config_from_args
    config, given = config_from_args(_parser().parse_args(["run", "--algorithm", "spafl"]))
    assert config.lr is None and "lr" not in given


