"""HeteroFL: per-entry aggregation by hand, nested width slices, the masked model
equals the sliced sub-model, exact bits/FLOPs, and learning on digits."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.core import accounting
from fedjax_sparse.algorithms import make_algorithm
from fedjax_sparse.algorithms.heterofl_family import parse_rates
from fedjax_sparse.mechanisms.widths import WidthLayout, kept_channels, per_entry_mean
from fedjax_sparse.cli import main
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models import make_model
from helpers import (assert_sliced_equals_masked, load_script, make_task, static_training_flops_per_example,
                     tiny_federated)


@pytest.mark.fast
def test_per_entry_mean_by_hand():
    old = {"w": jnp.array([10.0, 10.0, 10.0, 10.0])}
    stacked = {"w": jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 0.0, 2.0, 6.0]])}
    held = {"w": jnp.array([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])}
    new = per_entry_mean(old, stacked, held, jnp.ones(3))
    # entry 0: clients 0, 1 -> (1 + 5) / 2; entry 1: client 0 only; entry 2: nobody -> old; entry 3: all three.
    np.testing.assert_allclose(new["w"], [3.0, 2.0, 10.0, 6.0])
    weighted = per_entry_mean(old, stacked, held, jnp.array([1.0, 3.0, 1.0]))
    np.testing.assert_allclose(weighted["w"], [(1 + 15) / 4, 2.0, 10.0, (4 + 24 + 6) / 5])


@pytest.mark.fast
def test_rates_and_ceil():
    assert parse_rates("1,0.5,0.25") == (1.0, 0.5, 0.25)
    for bad in ("", "0", "1.5", "a"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    assert kept_channels(0.5, 20) == 10 and kept_channels(0.6, 50) == 30 and kept_channels(0.5, 25) == 13
    assert kept_channels(0.01, 10) == 1
    assert int(kept_channels(jnp.float32(0.6), 50)) == 30 and int(kept_channels(jnp.float32(0.5), 25)) == 13


def test_lenet_half_width_sub_model_counted_by_hand():
    model = make_model("lenet5_caffe", (28, 28, 1), 10)
    variables = model.init(jax.random.PRNGKey(0))
    layout = WidthLayout.from_model(model, variables)
    counts = layout.static_counts(0.5)
    assert counts == (10, 25, 250, 10)
    # conv1 5*5*1*10, conv2 5*5*10*25, fc1 (16 positions * 25 channels) * 250, fc2 250 * 10
    by_hand = 250 + 6250 + 400 * 250 + 2500
    assert layout.num_values(counts) == by_hand == 109_000
    assert layout.num_values(layout.out_channels) == model.num_params == 430_500
    assert int(layout.bits(jnp.asarray(counts))) == 32 * by_hand
    held = layout.held(variables, jnp.asarray(counts))
    assert sum(int(x.sum()) for x in jax.tree_util.tree_leaves(held)) == by_hand
    # fc1's input feature f is conv2's channel f % 50 (NHWC flatten)
    rows = np.asarray(held["params"]["fc1"]["kernel"][:, 0])
    np.testing.assert_array_equal(rows, (np.arange(800) % 50 < 25).astype(np.float32))
    # FLOPs: 6 x MACs of the sliced layers per example
    macs = 24 * 24 * 25 * 10 + 8 * 8 * 25 * 10 * 25 + 400 * 250 + 250 * 10
    assert static_training_flops_per_example(layout, counts) == 6 * macs
    assert int(layout.training_flops(jnp.asarray(counts), 7)) == 7 * 6 * macs


def test_masked_model_is_the_sliced_sub_model_and_nests():
    model = make_model("mlp", (4, 4, 1), 3, hidden=6)
    variables = model.init(jax.random.PRNGKey(1))
    layout = WidthLayout.from_model(model, variables)
    x = jax.random.normal(jax.random.PRNGKey(2), (5, 4, 4, 1))
    counts = layout.static_counts(0.5)
    assert counts == (3, 3, 3)
    p = variables["params"]
    h = jax.nn.relu(x.reshape(5, -1) @ p["fc1"]["kernel"][:, :3] + p["fc1"]["bias"][:3])
    h = jax.nn.relu(h @ p["fc2"]["kernel"][:3, :3] + p["fc2"]["bias"][:3])
    sliced = h @ p["fc3"]["kernel"][:3] + p["fc3"]["bias"]
    masked, _ = model.apply(variables, x, hooks=layout.hooks(jnp.asarray(counts)))
    np.testing.assert_allclose(masked, sliced, rtol=1e-5, atol=1e-6)
    # Nested: the 0.25 sub-model's held entries are a subset of the 0.5 one's.
    small = layout.held(variables, layout.counts(0.25))
    big = layout.held(variables, layout.counts(0.5))
    pairs = list(zip(jax.tree_util.tree_leaves(small), jax.tree_util.tree_leaves(big)))
    assert all(bool(jnp.all(s <= b)) for s, b in pairs)
    assert sum(float(s.sum()) for s, _ in pairs) < sum(float(b.sum()) for _, b in pairs)


def test_one_round_keeps_unheld_entries_and_counts_exact_costs():
    _, data = tiny_federated()
    task = make_task(data, lr=0.1)
    engine = Engine(make_algorithm("heterofl", task, {"rates": "0.5"}), 6, 3)
    state = engine.init(jax.random.PRNGKey(0))
    layout = WidthLayout.from_model(task.model, state.server.variables)
    old = jax.tree_util.tree_map(np.array, state.server.variables["params"])
    new, metrics = engine.run_rounds(state, data, 1)
    new = new.server.variables["params"]
    # fc1 has 64 outputs: the half-width clients hold fc2's first 32 input rows, conv1's first 8 filters.
    rows = np.abs(np.asarray(new["fc2"]["kernel"]) - old["fc2"]["kernel"]).max(axis=1) > 0
    assert not rows[32:].any() and rows[:32].mean() > 0.5
    filters = np.abs(np.asarray(new["conv1"]["kernel"]) - old["conv1"]["kernel"]).reshape(-1, 16).max(0) > 0
    assert not filters[8:].any() and filters[:8].all()
    half = layout.num_values(layout.static_counts(0.5))
    assert int(metrics["uplink_bits"][0]) == int(metrics["downlink_bits"][0]) == 3 * 32 * half
    examples = int(metrics["num_examples"][0])
    assert int(metrics["flops"][0]) == examples * static_training_flops_per_example(layout, layout.static_counts(0.5))


def test_learns_on_digits(tmp_path):
    out = tmp_path / "run"
    code = main(["run", "--algorithm", "heterofl", "--dataset", "digits", "--num-clients", "6",
                 "--clients-per-round", "3", "--rounds", "4", "--local-epochs", "2", "--batch-size", "32",
                 "--lr", "0.1", "--partition", "iid", "--option", "momentum=0.9", "--quiet", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.5   # chance 0.1; measured 0.76 (FedAvg, no momentum: 0.65)
    assert summary["total_uplink_bits"] % accounting.FLOAT_BITS == 0


def test_table2_gbit_check():
    # experiments/reproduce/baseline_costs.py: SpaFL's FMNIST Gbit column (docs/baselines.md)
    baseline_costs = load_script("reproduce/baseline_costs.py")
    table = baseline_costs.costs()
    assert table["heterofl"][0] == pytest.approx(34.88)          # exact 109,000-value sub-model
    assert table["heterofl"][2] == pytest.approx(68.88)          # paper: p x dense, to the digit
    assert table["fedpm"][0] == pytest.approx(71.0325)           # 33 bits x 430,500 x 5,000
    assert table["fjord"][0] == pytest.approx(50.016)
    # CIFAR-10 (cnn7): FedAvg's and FedPM's column agree to 0.01 % (804,800 kernel entries + 2 x 1,280 BN
    # values; FedPM 1 + 32 bits per kernel entry, running stats at 32 bits both ways)
    cifar10 = baseline_costs.costs("cifar10")
    assert cifar10["fedavg"][0] == pytest.approx(64 * 807_360 * 5000 / 1e9) == pytest.approx(258.36, rel=1e-4)
    assert cifar10["fedpm"][0] == pytest.approx((33 * 804_800 + 64 * 1_280) * 5000 / 1e9)
    assert cifar10["fedpm"][0] == pytest.approx(133.19, rel=2e-4)
    # CIFAR-100 (ResNet-18, width 64): the p = 0.5 sub-model is the width-32 ResNet with 100 classes:
    # 2,790,240 conv weights (the reference code's network, test_spafl_models), a 256 x 100 + 100
    # classifier and 4 BN values per channel of the stem (32), the pre-activations (736) and the blocks'
    # inner BNs (960).
    cifar100 = baseline_costs.costs("cifar100")
    half = 2_790_240 + 256 * 100 + 100 + 4 * (32 + 736 + 960)
    assert cifar100["heterofl"][0] == pytest.approx(64 * half * 15_000 / 1e9)
    full = 11_159_232 + 512 * 100 + 100 + 4 * (64 + 2 * 736 + 2 * 960)
    assert cifar100["fedavg"][0] == pytest.approx(64 * full * 15_000 / 1e9) == pytest.approx(10712, rel=0.01)


def test_models_with_undeclared_parameters_are_refused_in_one_line():
    # the ViT's embeddings and LayerNorms follow no layer's output channels
    model = make_model("vit_small", (32, 32, 3), 10, depth=1)
    with pytest.raises(ValueError, match="needs every parameter to belong to a weight layer.*embedding"):
        WidthLayout.from_model(model, model.init(jax.random.PRNGKey(0)))


def _resnet_with_random_batch_norm():
    """A narrow ResNet whose BN scales/biases are far from 1/0, so a pre-activation of a
    zeroed stream channel is relu(bn_bias) != 0 unless it is masked."""
    model = make_model("resnet18_narrow", (32, 32, 3), 7, width=4, conv_impl="xla")
    variables = model.init(jax.random.PRNGKey(0))
    leaves, tree = jax.tree_util.tree_flatten(variables)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) if x.ndim == 1 else x for x, k in zip(leaves, keys)]
    return model, jax.tree_util.tree_unflatten(tree, leaves)


def test_resnet_half_width_sub_model_is_the_masked_full_model():
    model, variables = _resnet_with_random_batch_norm()
    layout = WidthLayout.from_model(model, variables)
    counts = layout.static_counts(0.5)
    stage = {"conv1": 2, "layer1": 2, "layer2": 4, "layer3": 8, "layer4": 16}
    assert counts == tuple(stage[n.split("_")[0]] for n in layout.names[:-1]) + (7,)
    sub = layout.slice(variables, counts)
    # the pre-activation BN of block layer2_0 runs over the stream = layer1_1_conv2's kept channels
    assert sub["params"]["layer2_0_preact"]["bn_scale"].shape == (2,)
    assert sub["batch_stats"]["layer2_0_preact"]["var"].shape == (2,)
    assert sub["params"]["layer2_0_shortcut"]["kernel"].shape == (1, 1, 2, 4)
    # exact size: every value of the cut-out model, pre-activations included, and nothing else
    size = sum(int(x.size) for x in jax.tree_util.tree_leaves(sub))
    assert layout.num_values(counts) == size
    held = layout.held(variables, jnp.asarray(counts))
    assert sum(int(x.sum()) for x in jax.tree_util.tree_leaves(held)) == size
    assert layout.num_values(layout.out_channels) == sum(int(x.size) for x in jax.tree_util.tree_leaves(variables))
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 32, 32, 3))
    y = jnp.array([0, 3, 6])

    def loss(v, hooks):
        logits, stats = model.apply(v, x, train=True, hooks=hooks)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1).mean(), (logits, stats)

    @jax.jit
    def both(variables, sub):
        grad = jax.grad(lambda p, v, h: loss({**v, "params": p}, h), has_aux=True)
        g_sub, (logits_sub, stats_sub) = grad(sub["params"], sub, layout.hooks(jnp.asarray(counts)))
        g_full, (logits_full, stats_full) = grad(variables["params"], variables, layout.hooks(jnp.asarray(counts)))
        return g_sub, logits_sub, stats_sub, g_full, logits_full, stats_full

    g_sub, logits_sub, stats_sub, g_full, logits_full, stats_full = both(variables, sub)
    np.testing.assert_allclose(logits_sub, logits_full, rtol=1e-5, atol=1e-5)
    # training the masked full model moves exactly the sub-model's entries, as the sliced one does
    zeros = jax.tree_util.tree_map(jnp.zeros_like, variables)
    zero_stats = layout.slice(zeros, counts)["batch_stats"]
    g_back = layout.unslice(zeros, {"params": g_sub, "batch_stats": zero_stats}, counts)["params"]
    for a, b in zip(jax.tree_util.tree_leaves(g_back), jax.tree_util.tree_leaves(g_full)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    stats_back = layout.slice({"params": variables["params"], "batch_stats": stats_full}, counts)["batch_stats"]
    for a, b in zip(jax.tree_util.tree_leaves(stats_sub), jax.tree_util.tree_leaves(stats_back)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_slice_cuts_the_sub_model_out_and_unslice_writes_it_back():
    model = make_model("lenet5_caffe", (28, 28, 1), 10)
    variables = model.init(jax.random.PRNGKey(0))
    layout = WidthLayout.from_model(model, variables)
    counts = layout.static_counts(0.5)
    sub = layout.slice(variables, counts)
    shapes = {name: sub["params"][name]["kernel"].shape for name in layout.names}
    # fc1 keeps the 16 positions x 25 kept conv2 channels; fc2 all 10 classes
    assert shapes == {"conv1": (5, 5, 1, 10), "conv2": (5, 5, 10, 25), "fc1": (400, 250), "fc2": (250, 10)}
    assert sum(int(x.size) for x in jax.tree_util.tree_leaves(sub)) == layout.num_values(counts) == 109_000
    fc1 = np.asarray(variables["params"]["fc1"]["kernel"])
    np.testing.assert_array_equal(sub["params"]["fc1"]["kernel"], fc1[np.arange(800) % 50 < 25, :250])
    # the sliced network computes what the masked full network does
    x = jax.random.uniform(jax.random.PRNGKey(3), (4, 28, 28, 1)) * 255
    masked, _ = model.apply(variables, x, hooks=layout.hooks(jnp.asarray(counts)))
    np.testing.assert_allclose(model.apply(sub, x)[0], masked, rtol=2e-5, atol=1e-4)
    # writing back: held entries replaced, everything else untouched
    bumped = jax.tree_util.tree_map(lambda v: v + 1.0, sub)
    back = layout.unslice(variables, bumped, counts)
    held = layout.held(variables, jnp.asarray(counts))
    for new, old, h in zip(*(jax.tree_util.tree_leaves(t) for t in (back, variables, held))):
        np.testing.assert_allclose(np.asarray(new) - np.asarray(old), np.asarray(h), atol=1e-5)


@pytest.mark.parametrize("rates", ["0.5", "1,0.5"])
def test_sliced_training_equals_the_masked_full_model(rates):
    assert_sliced_equals_masked("heterofl", {"rates": rates})
