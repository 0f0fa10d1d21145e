"""Defaults that train (issue 42 item 5): with no learning rate given, every algorithm takes its own
default (``fedjax_sparse.driver.catalog.ALGORITHM_LR``), recorded in config.json, and trains the built-in
image data sets with finite loss. The fast test runs every algorithm on the embedded digits; the slow
one every algorithm on every built-in image data set found under ``../shared/data``."""
import json
import math
from pathlib import Path

import pytest

import fedjax_sparse as fjs
from fedjax_sparse.algorithms import algorithm_names
from fedjax_sparse.driver.catalog import DEFAULT_LR, default_lr

DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"
# A few rounds of a small population: the defaults' first steps, not a training run.
TINY = dict(num_clients=40, clients_per_round=2, rounds=2, local_epochs=1, batch_size=32, partition="iid",
            eval_every=2)
IMAGE_DATASETS = ("mnist", "fashion_mnist", "emnist_letters", "cifar10", "cifar100", "cifar10_sample", "svhn")
# Seen, not a learning-rate matter: Caldas et al.'s dropout on cnn7 (BatchNorm) gives a NaN loss in round 1
# at every lr tried (0.1 ... 0.01) under this suite's XLA:CPU flags (backend optimisation level 0, the
# legacy fusion emitters: conftest.py), and trains (loss 2.32) with XLA's default flags. Left open.
KNOWN_NAN = {("caldas", "cifar10_sample"), ("caldas", "cifar10")}


def finite_losses(result) -> bool:
    losses = [row.get("loss") for row in result.rows]
    return bool(losses) and all(loss is not None and math.isfinite(loss) for loss in losses)


def test_an_unset_learning_rate_is_the_algorithms_default_and_recorded(tmp_path):
    """The cheap variant of the matrices below: the default is resolved, used and recorded (SpaFL's changed:
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


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_trains_the_digits_with_its_default_learning_rate(algorithm):
    result = fjs.run(fjs.RunConfig(algorithm=algorithm, dataset="digits", **{**TINY, "num_clients": 8}),
                     progress=False)
    assert result.config.lr == default_lr(algorithm) and finite_losses(result), result.rows


@pytest.mark.slow
@pytest.mark.parametrize("dataset", IMAGE_DATASETS)
def test_every_algorithm_trains_every_built_in_image_data_set_with_its_default_learning_rate(dataset):
    if not any((DATA_DIR / name).is_dir() for name in (dataset, dataset.replace("_sample", ""))):
        pytest.skip(f"{dataset} not in {DATA_DIR}")
    data = fjs.data.load(dataset, DATA_DIR)
    failed = {}
    for algorithm in algorithm_names():
        try:
            result = fjs.run(fjs.RunConfig(algorithm=algorithm, dataset=dataset, **TINY), data=data, progress=False)
        except fjs.RunError as e:
            if "diverged" in str(e):
                failed[algorithm] = str(e)
            # else: the algorithm refuses the data set's default model in one line (BatchNorm, biases)
            continue
        if not finite_losses(result):
            failed[algorithm] = [row.get("loss") for row in result.rows]
    assert set(failed) == {a for a, d in KNOWN_NAN if d == dataset}, failed
