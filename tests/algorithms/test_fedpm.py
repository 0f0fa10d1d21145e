"""FedPM: the server's Beta-posterior estimate from hand-made samples, Bernoulli
sampling frequency and its straight-through gradient, the frozen +-c weights,
exact bits, and learning on digits."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.core import accounting
from fedjax_sparse.algorithms import make_algorithm
from fedjax_sparse.algorithms.fedpm_family import bernoulli_st, posterior_probs, sample_masks, signed_constant_kernels
from fedjax_sparse.cli import main
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models import make_model
from helpers import make_task, tiny_federated

SAMPLES = {"w": jnp.array([[1, 0, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], bool)}   # K = 3 clients


@pytest.mark.fast
def test_posterior_by_hand():
    # Reference ("mode" of Beta(1 + sum v, 1 + K - sum v), v = bits smoothed to eps / 1 - eps): mean of v.
    np.testing.assert_allclose(posterior_probs(SAMPLES, epsilon=0.0)["w"], [1.0, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(posterior_probs(SAMPLES)["w"], [0.99, 0.01 + 0.98 / 3, 0.01 + 0.98 / 3, 0.01],
                               rtol=1e-6)
    # Posterior mean: (sum + 1) / (K + 2).
    np.testing.assert_allclose(posterior_probs(SAMPLES, estimator="mean")["w"], [0.8, 0.4, 0.4, 0.2], rtol=1e-6)


def test_bernoulli_frequency_and_straight_through_gradient():
    logits = jnp.full((20000,), math.log(0.3 / 0.7))
    m = bernoulli_st(jax.random.PRNGKey(0), logits)
    assert set(np.unique(np.asarray(m))) == {0.0, 1.0}
    assert abs(float(m.mean()) - 0.3) < 0.01
    # d m / d logit = sigmoid'(logit) = p (1 - p), whatever the draw
    grad = jax.grad(lambda s: bernoulli_st(jax.random.PRNGKey(1), s).sum())(logits[:5])
    np.testing.assert_allclose(grad, 0.21, rtol=1e-5)
    masks = sample_masks(jax.random.PRNGKey(2), {"a": jnp.full((20000,), 0.8)})
    assert abs(float(masks["a"].mean()) - 0.8) < 0.01


def test_frozen_weights_are_signed_constants():
    model = make_model("cnn_small", (8, 8, 1), 10)
    frozen = signed_constant_kernels(jax.random.PRNGKey(0), model, model.init(jax.random.PRNGKey(0)))
    for layer in model.layers:
        k = np.asarray(frozen["params"][layer.name]["kernel"])
        c = math.e / math.sqrt(layer.fan_in)
        np.testing.assert_allclose(np.abs(k), c, rtol=1e-6)
        assert 0.45 < (k > 0).mean() < 0.55


@pytest.fixture(scope="module")
def one_round():
    _, data = tiny_federated()
    task = make_task(data, lr=0.1)
    engine = Engine(make_algorithm("fedpm", task, {}), 6, 3)
    state = engine.init(jax.random.PRNGKey(0))
    before = jax.tree_util.tree_map(np.array, state.server)
    new, metrics = engine.run_rounds(state, data, 1)
    return task, before, new.server, metrics


def test_weights_stay_frozen_and_p_is_a_mean_of_three_samples(one_round):
    task, before, after, _ = one_round
    for a, b in zip(jax.tree_util.tree_leaves(before.weights), jax.tree_util.tree_leaves(after.weights)):
        np.testing.assert_array_equal(a, b)
    # three smoothed bits: p in {0.01, 0.01 + 0.98 / 3, 0.01 + 2 * 0.98 / 3, 0.99}
    p = np.asarray(after.probs["fc1"]).ravel()
    levels = 0.01 + 0.98 * np.arange(4) / 3
    assert np.abs(p[:, None] - levels[None]).min(axis=1).max() < 1e-6


@pytest.mark.fast
def test_bits_and_flops_by_hand(one_round):
    task, _, _, metrics = one_round
    weights = sum(layer.num_weights for layer in task.model.layers)
    assert int(metrics["uplink_bits"][0]) == 3 * weights                # 1 bit per weight, 3 clients
    assert int(metrics["downlink_bits"][0]) == 3 * 32 * weights         # p as float32
    examples = int(metrics["num_examples"][0])
    assert int(metrics["flops"][0]) == examples * accounting.training_flops_per_example(task.model)


def test_learns_on_digits(tmp_path):
    out = tmp_path / "run"
    code = main(["run", "--algorithm", "fedpm", "--dataset", "digits", "--num-clients", "6",
                 "--clients-per-round", "3", "--rounds", "4", "--local-epochs", "2", "--batch-size", "32",
                 "--lr", "0.1", "--partition", "iid", "--quiet", "--out", str(out)])
    assert code == 0
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] > 0.4   # chance 0.1
