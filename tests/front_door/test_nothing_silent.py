"""Nothing accepted silently (issue 42 item 4): a class with no training example is named in a
warning; a ``--model`` target that is not a Flax module, a Model or a factory of one is refused in
one line saying what it is; the reprs of what ``build`` returns are short."""
import warnings

import numpy as np
import pytest

import fedjax_sparse as fjs
from fedjax_sparse.cli import main
from fedjax_sparse.errors import DataWarning
from fedjax_sparse.models import make_model


def arrays(test_labels):
    rng = np.random.default_rng(0)
    x_train, x_test = rng.integers(0, 255, (12, 4, 4, 1), np.uint8), rng.integers(0, 255, (4, 4, 4, 1), np.uint8)
    y_train = np.array([0, 1, 2] * 4)
    return x_train, y_train, x_test, np.array(test_labels)


@pytest.mark.fast
def test_a_class_only_in_the_test_split_is_named_in_a_warning():
    with pytest.warns(DataWarning, match=r"class\(es\) 3, 4 appear in y_test \(2 examples\) but in no training"):
        fjs.data.from_arrays(*arrays([0, 1, 3, 4]), partition="iid", num_clients=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fjs.data.from_arrays(*arrays([0, 1, 2, 2]), partition="iid", num_clients=2)   # every class trains
        # a class absent from both splits (num_classes larger than the labels) is no surprise
        fjs.data.from_arrays(*arrays([0, 1, 2, 2]), partition="iid", num_clients=2, num_classes=5)


@pytest.mark.fast
@pytest.mark.parametrize("target,said", [
    ("os.path:join", "os.path.join is a function that needs argument(s) a, not a Flax module"),
    ("math:pi", "math.pi is a float, not a Flax module"),
    ("collections:OrderedDict", "collections.OrderedDict is the class OrderedDict, not a Flax module"),
    ("platform:system", "platform.system() returned a str, not a Flax module"),
])
def test_a_model_target_that_is_no_model_is_refused_in_one_line(target, said, capsys):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        make_model(target, (8, 8, 1), 10)
    assert main(["run", "--dataset", "digits", "--model", target, "--rounds", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model {target}: ") and said in err and err.count("\n") == 1, err


@pytest.mark.fast
def test_reprs_of_what_build_returns_are_short():
    experiment = fjs.build(fjs.RunConfig(num_clients=4, clients_per_round=2, rounds=1))
    assert repr(experiment).startswith("Experiment(fedavg on digits: 4 clients") and len(repr(experiment)) < 200
    assert repr(experiment.data).startswith("FederatedData(4 clients, ") and len(repr(experiment.data)) < 200
