"""FjORD: ordered-dropout nesting, zero gradients beyond the step's width, its
p_min = p_max case equals HeteroFL, exact per-step costs, learning on digits."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import make_algorithm
from fedjax_sparse.algorithms.fjord_family import sample_width
from fedjax_sparse.mechanisms.widths import WidthLayout
from fedjax_sparse.cli import main
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models import make_model
from fedjax_sparse.core.training import masked_cross_entropy
from helpers import assert_sliced_equals_masked, make_task, static_training_flops_per_example, tiny_federated


def test_widths_nest_and_dropped_channels_get_zero_gradient():
    _, data = tiny_federated()
    model = make_task(data).model
    variables = model.init(jax.random.PRNGKey(0))
    layout = WidthLayout.from_model(model, variables)
    small, big = layout.counts(0.4), layout.counts(0.6)
    assert tuple(int(c) for c in small) == (7, 26, 4) and tuple(int(c) for c in big) == (10, 39, 4)
    for name in layout.names:   # the 0.4 channels are a prefix of the 0.6 ones
        s, b = layout.out_masks(small)[name], layout.out_masks(big)[name]
        assert bool(jnp.all(s <= b)) and int(s.sum()) == int(s[:int(s.sum())].sum())
    x = data.preprocess(jnp.asarray(data.train_x[:16]))
    y = jnp.asarray(data.train_y[:16])

    def loss(params):
        logits, _ = model.apply({**variables, "params": params}, x, train=True, hooks=layout.hooks(small))
        return masked_cross_entropy(logits, y, jnp.ones(16))
    grads = jax.grad(loss)(variables["params"])
    held = layout.held(variables, small)["params"]
    for g, h in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(held)):
        assert float(jnp.abs(g * (1 - h)).max()) == 0.0        # nothing outside the sub-model moves
        assert float(jnp.abs(g * h).max()) > 0.0


@pytest.mark.fast
def test_sampled_widths_are_uniform_in_range():
    ps = jax.vmap(lambda k: sample_width(k, 0.4, 0.6))(jax.random.split(jax.random.PRNGKey(0), 4000))
    assert 0.4 <= float(ps.min()) and float(ps.max()) <= 0.6
    assert abs(float(ps.mean()) - 0.5) < 0.005


def test_fixed_width_is_heterofl_and_costs_are_exact():
    _, data = tiny_federated()
    task = make_task(data, lr=0.1)
    states, metrics = {}, {}
    for name, options in (("fjord", {"p_min": 0.5, "p_max": 0.5}), ("heterofl", {"rates": "0.5"})):
        engine = Engine(make_algorithm(name, task, options), 6, 3)
        states[name], metrics[name] = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 1)
    for a, b in zip(jax.tree_util.tree_leaves(states["fjord"].server), jax.tree_util.tree_leaves(states["heterofl"].server)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for key in ("flops", "uplink_bits", "downlink_bits"):
        assert int(metrics["fjord"][key][0]) == int(metrics["heterofl"][key][0])


def test_random_widths_upload_the_widest_sub_model():
    _, data = tiny_federated()
    task = make_task(data, lr=0.1)
    engine = Engine(make_algorithm("fjord", task, {}), 6, 3)
    state = engine.init(jax.random.PRNGKey(0))
    layout = WidthLayout.from_model(task.model, state.server.variables)
    _, metrics = engine.run_rounds(state, data, 1)
    lo, hi = (layout.num_values(layout.static_counts(p)) for p in (0.4, 0.6))
    assert int(metrics["downlink_bits"][0]) == 3 * 32 * hi
    assert 3 * 32 * lo <= int(metrics["uplink_bits"][0]) <= 3 * 32 * hi
    examples = int(metrics["num_examples"][0])
    per_example = [static_training_flops_per_example(layout, layout.static_counts(p)) for p in (0.4, 0.6)]
    assert examples * per_example[0] <= int(metrics["flops"][0]) <= examples * per_example[1]


def test_learns_on_digits(tmp_path):
    out = tmp_path / "run"
    code = main(["run", "--algorithm", "fjord", "--dataset", "digits", "--num-clients", "6",
                 "--clients-per-round", "3", "--rounds", "4", "--local-epochs", "2", "--batch-size", "32",
                 "--lr", "0.1", "--partition", "iid", "--option", "momentum=0.9", "--quiet", "--out", str(out)])
    assert code == 0
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] > 0.5   # chance 0.1; measured 0.75


def test_sliced_p_max_sub_model_equals_the_masked_full_model():
    # Same keys, so the same per-step widths: training the cut-out p_max sub-model with each step's
    # narrower width zeroed inside it is the masked full model's computation, at a fraction of its cost.
    assert_sliced_equals_masked("fjord", {"momentum": 0.5})


def test_resnet_sliced_equals_masked():
    # Residual width scaling (mechanisms.widths.WidthLayout.attached, the ResNet's activation hooks): the p_max
    # sub-model with each step's narrower width zeroed inside it, pre-activations included, is the
    # masked full ResNet's computation. Not a check of the pre-activation hook: from a fresh init the
    # untrained channels' BN biases are 0 and relu(0) hides it; test_heterofl's ResNet test, with random
    # BN, is.
    model = make_model("resnet18_narrow", (32, 32, 3), 4, width=4, conv_impl="xla")
    assert_sliced_equals_masked("fjord", {}, rounds=1, model=model, shape=(32, 32, 3), sizes=(9, 14, 11))
