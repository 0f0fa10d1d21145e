"""The FSL paper's models and communication figures against its Tables 1 and 3."""
import math

import jax
import jax.numpy as jnp
import pytest

from fedjax_sparse.mechanisms import supermask as sm
from fedjax_sparse.algorithms.robust import topk_uplink_bits
from fedjax_sparse.models import make_model

pytestmark = pytest.mark.fast   # the whole file is in the fast tier (python -m pytest -m fast)

# Table 3: edges (weights) per layer.
TABLE3 = {
    "mnist_lenet": ("fsl_lenet", (28, 28, 1), 10, [288, 18432, 1605632, 1280]),
    "femnist_lenet": ("fsl_lenet", (28, 28, 1), 62, [288, 18432, 1605632, 7936]),
    "cifar_conv8": ("conv8", (32, 32, 3), 10, [1728, 36864, 73728, 147456, 294912, 589824, 1179648,
                                               2359296, 524288, 65536, 2560]),
}

# Table 1, per client per round, in the paper's "MB" (2^20 bytes), as printed.
TABLE1 = {
    # setting: {method: (upload, download)}
    "mnist_lenet": {"fedavg": (6.20, 6.20), "fsl": (4.05, 4.05), "sfsl50": (2.03, 4.05), "sfsl10": (0.40, 4.05),
                    "signsgd": (0.19, 6.20), "topk50": (3.29, 6.20), "topk10": (0.81, 6.20)},
    "cifar_conv8": {"fedavg": (20.1, 20.1), "fsl": (13.1, 13.1), "sfsl50": (6.5, 13.1), "sfsl10": (1.3, 13.1),
                    "signsgd": (0.63, 20.1), "topk50": (10.69, 20.1), "topk10": (2.64, 20.1)},
    "femnist_lenet": {"fedavg": (6.23, 6.23), "fsl": (4.06, 4.06), "sfsl50": (2.03, 4.06), "sfsl10": (0.40, 4.06),
                      "signsgd": (0.19, 6.23), "topk50": (3.31, 6.23), "topk10": (0.81, 6.23)},
}


def _model(setting):
    name, shape, classes, _ = TABLE3[setting]
    return make_model(name, shape, classes)


@pytest.mark.parametrize("setting", sorted(TABLE3))
def test_edges_per_layer_match_table3(setting):
    model = _model(setting)
    assert [layer.num_weights for layer in model.layers] == TABLE3[setting][3]


def test_conv8_has_5275840_weights_and_no_biases():
    model = _model("cifar_conv8")
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0))["params"]
    assert sum(math.prod(p["kernel"].shape) for p in params.values()) == 5_275_840
    assert all(set(p) == {"kernel"} for p in params.values())


def test_lenet_forward_shape():
    model = _model("mnist_lenet")
    logits, _ = model.apply(model.init(jax.random.PRNGKey(0)), jnp.zeros((2, 28, 28, 1)))
    assert logits.shape == (2, 10)


def _method_mb(method, sizes):
    """Upload and download MB of one client per round, from our accounting."""
    p = sum(sizes)
    dense = sm.mebibytes(32 * p)
    if method == "fedavg":
        return dense, dense
    if method.startswith("sfsl") or method == "fsl":
        fraction = 1.0 if method == "fsl" else int(method[4:]) / 100
        return sm.mebibytes(sm.ranking_bits(sizes, fraction)), sm.mebibytes(sm.ranking_bits(sizes))
    if method == "signsgd":
        return sm.mebibytes(p), dense
    fraction = int(method[4:]) / 100
    return sm.mebibytes(topk_uplink_bits(p, sm.kept_count(p, fraction), "bitmap")), dense


@pytest.mark.parametrize("setting", sorted(TABLE1))
def test_communication_matches_table1(setting):
    sizes = TABLE3[setting][3]
    for method, paper in TABLE1[setting].items():
        ours = _method_mb(method, sizes)
        for value, printed in zip(ours, paper):
            decimals = len(f"{printed}".split(".")[1])
            # The paper rounds some figures and truncates others (FEMNIST FSL 4.065 -> 4.06,
            # SFSL 10 % 0.405 -> 0.40, Conv8 FSL 13.07 -> 13.1): agree to within one printed unit.
            assert abs(value - printed) < 10 ** -decimals, (setting, method, value, printed)
            assert math.floor(value * 10 ** decimals) <= round(printed * 10 ** decimals) <= math.ceil(value * 10 ** decimals)


def test_fsl_mnist_lenet_is_4_05_mb():
    bits = sm.ranking_bits(TABLE3["mnist_lenet"][3])
    # sum_l n_l ceil(log2 n_l) = 288*9 + 18432*15 + 1605632*21 + 1280*11
    assert bits == 288 * 9 + 18432 * 15 + 1605632 * 21 + 1280 * 11
    assert round(sm.mebibytes(bits), 2) == 4.05
