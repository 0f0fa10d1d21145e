"""FedProx, SCAFFOLD and Caldas et al.'s federated dropout against hand computations."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import ServerContext, Task, make_algorithm
from fedjax_sparse.core.algorithm import ClientContext
from fedjax_sparse.algorithms.baselines import ScaffoldClientState, sample_unit_masks, weight_inclusion
from fedjax_sparse.data.federated import ClientData, build_federated_data
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models.base import Conv, Dense, Flatten, sequential

LR = 0.1


def linear_model():
    """Softmax regression on 2x2 images: logits = x W + b."""
    return sequential("linear", (2, 2, 1), 3, [Flatten(), Dense("fc", 3, bias=True, relu=False)])


def conv_model():
    return sequential("tiny", (8, 8, 1), 3, [Conv("conv1", 4, 3, padding="SAME", bias=True, pool=2),
                                             Conv("conv2", 6, 3, bias=True), Flatten(),
                                             Dense("fc1", 5, bias=True), Dense("fc2", 3, bias=True, relu=False)])


def make_data(image_shape, counts, seed=0):
    rng = np.random.default_rng(seed)
    n = int(sum(counts))
    ds = SimpleNamespace(train_x=rng.integers(0, 255, (n,) + image_shape, dtype=np.uint8),
                         train_y=rng.integers(0, 3, n).astype(np.int32),
                         test_x=rng.integers(0, 255, (12,) + image_shape, dtype=np.uint8),
                         test_y=rng.integers(0, 3, 12).astype(np.int32), num_classes=3)
    starts = np.cumsum([0] + list(counts))
    part = SimpleNamespace(train_indices=[np.arange(starts[i], starts[i + 1]) for i in range(len(counts))],
                           test_indices=[np.arange(3 * i, 3 * i + 3) for i in range(len(counts))],
                           test_from_train=False)
    return build_federated_data(ds, part)


def make_task(model, data, *, batch_size, epochs=1, clients_per_round=None):
    n = data.num_clients
    return Task(model=model, num_clients=n, clients_per_round=clients_per_round or n, local_epochs=epochs,
                batch_size=batch_size, lr=LR, rounds=2, preprocess=data.preprocess)


def client_view(data, i):
    return ClientData(data.train_x, data.train_y, data.train_idx[i], data.train_count[i])


def context(i, round_=0):
    return ClientContext(jnp.int32(round_), jnp.int32(i), jax.random.PRNGKey(10 + i), jax.random.PRNGKey(99))


def softmax_grads(w, b, x, y):
    """Mean cross-entropy gradient of logits = x w + b (numpy)."""
    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    err = (p - np.eye(3)[y]) / len(y)
    return x.T @ err, err.sum(0)


def client_arrays(data, i):
    idx = np.asarray(data.train_idx[i][:int(data.train_count[i])])
    x = np.asarray(data.train_x)[idx].reshape(len(idx), -1).astype(np.float64) / 255.0
    return x, np.asarray(data.train_y)[idx]


def model_bits(variables):
    return 32 * sum(x.size for x in jax.tree_util.tree_leaves(variables))


# ---------------------------------------------------------------- FedProx
@pytest.mark.fast
def test_fedprox_two_full_batch_steps_match_the_formula():
    mu = 0.5
    data = make_data((2, 2, 1), [4])
    alg = make_algorithm("fedprox", make_task(linear_model(), data, batch_size=4, epochs=2), {"mu": mu})
    server, _ = alg.init(jax.random.PRNGKey(0))
    variables = alg.broadcast(server, 0)
    _, new, metrics = jax.jit(alg.client_update)(variables, (), client_view(data, 0), context(0))
    x, y = client_arrays(data, 0)
    w0 = np.asarray(variables["params"]["fc"]["kernel"], np.float64)
    b0 = np.asarray(variables["params"]["fc"]["bias"], np.float64)
    w, b = w0.copy(), b0.copy()
    for _ in range(2):  # w <- w - lr (grad + mu (w - w_global))
        gw, gb = softmax_grads(w, b, x, y)
        w, b = w - LR * (gw + mu * (w - w0)), b - LR * (gb + mu * (b - b0))
    np.testing.assert_allclose(new["params"]["fc"]["kernel"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["params"]["fc"]["bias"], b, rtol=1e-5, atol=1e-6)
    # Without the proximal term the second step differs: the check above can fail.
    gw, gb = softmax_grads(w0, b0, x, y)
    w1 = w0 - LR * gw
    assert not np.allclose(w, w1 - LR * softmax_grads(w1, b0 - LR * gb, x, y)[0], atol=1e-6)
    assert float(metrics["uplink_bits"]) == float(metrics["downlink_bits"]) == model_bits(variables)


# ---------------------------------------------------------------- SCAFFOLD
def test_scaffold_option_two_step_and_control_variate():
    data = make_data((2, 2, 1), [4, 4])
    task = make_task(linear_model(), data, batch_size=4)
    alg = make_algorithm("scaffold", task, {"variant": "II"})
    server, clients = alg.init(jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    randomise = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda v: jnp.asarray(rng.normal(size=v.shape), jnp.float32), tree)
    server = server._replace(control=randomise(server.control))
    client_state = ScaffoldClientState(randomise(jax.tree_util.tree_map(lambda v: v[0], clients.control)))
    state, message, metrics = jax.jit(alg.client_update)(alg.broadcast(server, 0), client_state,
                                                         client_view(data, 0), context(0))
    x, y = client_arrays(data, 0)
    w0 = np.asarray(server.variables["params"]["fc"]["kernel"], np.float64)
    b0 = np.asarray(server.variables["params"]["fc"]["bias"], np.float64)
    gw, gb = softmax_grads(w0, b0, x, y)
    ci, c = client_state.control["fc"], server.control["fc"]
    # One step: y = x - lr (g(x) - c_i + c).
    expected_w = w0 - LR * (gw - np.asarray(ci["kernel"]) + np.asarray(c["kernel"]))
    np.testing.assert_allclose(message["variables"]["params"]["fc"]["kernel"], expected_w, rtol=1e-5, atol=1e-6)
    # Option II after one step: c_i+ = c_i - c + (x - y) / lr = g(x).
    np.testing.assert_allclose(state.control["fc"]["kernel"], gw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state.control["fc"]["bias"], gb, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(message["delta_control"]["fc"]["kernel"], gw - np.asarray(ci["kernel"]),
                               rtol=1e-4, atol=1e-6)
    # Model and control variate both ways.
    assert float(metrics["uplink_bits"]) == float(metrics["downlink_bits"]) == 2 * model_bits(server.variables)


def test_scaffold_option_one_uses_the_full_local_gradient():
    data = make_data((2, 2, 1), [5, 3])  # 5 samples in batches of 2: partial last batch
    task = make_task(linear_model(), data, batch_size=2, epochs=2)
    alg = make_algorithm("scaffold", task, {"variant": "I"})
    server, clients = alg.init(jax.random.PRNGKey(0))
    client_state = jax.tree_util.tree_map(lambda v: v[0], clients)
    state, _, metrics = jax.jit(alg.client_update)(alg.broadcast(server, 0), client_state,
                                                   client_view(data, 0), context(0))
    x, y = client_arrays(data, 0)
    gw, gb = softmax_grads(np.asarray(server.variables["params"]["fc"]["kernel"], np.float64),
                           np.asarray(server.variables["params"]["fc"]["bias"], np.float64), x, y)
    np.testing.assert_allclose(state.control["fc"]["kernel"], gw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state.control["fc"]["bias"], gb, rtol=1e-4, atol=1e-6)
    # FLOPs: 2 epochs of training plus one extra pass for the gradient = 3 passes of 5 examples.
    assert float(metrics["flops"]) == pytest.approx(3 * 5 * 3 * 2 * 4 * 3)


@pytest.mark.fast
def test_scaffold_server_update_formula():
    data = make_data((2, 2, 1), [4, 4, 4, 4])
    task = make_task(linear_model(), data, batch_size=4, clients_per_round=2)
    alg = make_algorithm("scaffold", task, {"server_lr": 0.5})
    server, _ = alg.init(jax.random.PRNGKey(0))
    server = server._replace(control=jax.tree_util.tree_map(lambda v: v + 1.0, server.control))
    y1 = jax.tree_util.tree_map(lambda v: v + 2.0, server.variables)
    y2 = jax.tree_util.tree_map(lambda v: v - 2.0, server.variables)
    dc1 = jax.tree_util.tree_map(lambda v: jnp.full_like(v, 4.0), server.control)
    dc2 = jax.tree_util.tree_map(lambda v: jnp.full_like(v, -8.0), server.control)
    stack = lambda a, b: jax.tree_util.tree_map(lambda u, v: jnp.stack([u, v]), a, b)  # noqa: E731
    messages = {"variables": stack(y1, y2), "delta_control": stack(dc1, dc2)}
    ctx = ServerContext(jnp.int32(0), jnp.array([0, 2], jnp.int32), jnp.array([1.0, 3.0]), jax.random.PRNGKey(0))
    new, _ = alg.server_update(server, messages, ctx)
    # x + 0.5 * (0.25 * 2 + 0.75 * -2); c + (4 - 8) / N with N = 4 clients.
    np.testing.assert_allclose(new.variables["params"]["fc"]["kernel"],
                               server.variables["params"]["fc"]["kernel"] - 0.5, rtol=1e-6)
    np.testing.assert_allclose(new.control["fc"]["kernel"], server.control["fc"]["kernel"] - 1.0)


# ---------------------------------------------------------------- Caldas et al.
def test_unit_masks_and_weight_inclusion():
    model = conv_model()
    masks = sample_unit_masks(jax.random.PRNGKey(0), model, ["conv1", "conv2", "fc1"], 0.5)
    assert [int(masks[n].sum()) for n in ("conv1", "conv2", "fc1")] == [2, 3, 2]  # round(0.5 C)
    inclusion = weight_inclusion(model, masks)
    conv2 = inclusion["conv2"]["kernel"]
    assert conv2.shape == (3, 3, 4, 6)
    np.testing.assert_array_equal(conv2[1, 2], np.outer(masks["conv1"], masks["conv2"]))
    # fc1 reads the flattened 2x2x6 conv2 map: input feature r is channel r % 6 (NHWC).
    fc1 = np.asarray(inclusion["fc1"]["kernel"])
    for r in range(24):
        np.testing.assert_array_equal(fc1[r], float(masks["conv2"][r % 6]) * np.asarray(masks["fc1"]))
    np.testing.assert_array_equal(inclusion["fc2"]["bias"], 1.0)  # logits are never dropped


def test_caldas_trains_the_sub_model_and_averages_over_holders():
    data = make_data((8, 8, 1), [6, 6])
    task = make_task(conv_model(), data, batch_size=4)
    alg = make_algorithm("caldas", task, {"keep": 0.5, "per_client": True})
    server, _ = alg.init(jax.random.PRNGKey(0))
    payload = alg.broadcast(server, 0)
    update = jax.jit(alg.client_update)
    outs = [update(payload, (), client_view(data, i), context(i)) for i in range(2)]
    model, old = task.model, server.variables["params"]
    sub_model = jax.jit(lambda key: weight_inclusion(model, sample_unit_masks(key, model, ["conv1", "conv2", "fc1"],
                                                                             0.5)))
    inclusions = [sub_model(jax.random.fold_in(jax.random.fold_in(server.mask_key, 0), i)) for i in range(2)]
    for (_, new, metrics), inc in zip(outs, inclusions):
        for layer in model.layers:
            held = np.asarray(inc[layer.name]["kernel"]) > 0
            k_old, k_new = np.asarray(old[layer.name]["kernel"]), np.asarray(new["params"][layer.name]["kernel"])
            np.testing.assert_array_equal(k_new[~held], k_old[~held])  # outside the sub-model: untouched
            assert not np.allclose(k_new[held], k_old[held])
        # Communication: the sub-model's weights (kernels and biases) at 32 bits, both ways.
        sub = sum(float(inc[l.name]["kernel"].sum() + inc[l.name]["bias"].sum()) for l in model.layers)
        assert float(metrics["uplink_bits"]) == float(metrics["downlink_bits"]) == 32 * sub
    messages = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), outs[0][1], outs[1][1])
    ctx = ServerContext(jnp.int32(0), jnp.array([0, 1], jnp.int32), jnp.array([1.0, 3.0]), jax.random.PRNGKey(0))
    new, _ = jax.jit(alg.server_update)(server, messages, ctx)
    flat = lambda trees: [np.concatenate([np.asarray(t[l.name]["kernel"]).ravel() for l in model.layers])  # noqa: E731
                          for t in trees]
    kernel, k0, k1, k_old = flat([new.variables["params"], outs[0][1]["params"], outs[1][1]["params"], old])
    h0, h1 = (held > 0 for held in flat(inclusions))
    both, only0, none = h0 & h1, h0 & ~h1, ~h0 & ~h1
    np.testing.assert_allclose(kernel[both], 0.25 * k0[both] + 0.75 * k1[both], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(kernel[only0], k0[only0], rtol=1e-6)
    np.testing.assert_array_equal(kernel[none], k_old[none])
    assert both.any() and only0.any() and none.any()


# ---------------------------------------------------------------- end to end
@pytest.mark.parametrize("name, options", [("fedprox", {}), ("scaffold", {}), ("caldas", {})])
def test_two_rounds_end_to_end(name, options):
    data = make_data((8, 8, 1), [10, 7, 12, 5])
    task = make_task(conv_model(), data, batch_size=4, clients_per_round=3)
    alg = make_algorithm(name, task, options)
    engine = Engine(alg, task.num_clients, task.clients_per_round)
    state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2)
    for key in ("loss", "flops", "uplink_bits", "downlink_bits", "density", "num_examples"):
        assert bool(jnp.all(jnp.isfinite(metrics[key]))), key
    assert bool(jnp.all(metrics["flops"] > 0))
    evaluation = engine.evaluate(state, data)
    assert 0.0 <= evaluation["global_accuracy"] <= 1.0
    if name == "caldas":
        assert bool(jnp.all(metrics["density"] < 1.0))


@pytest.mark.parametrize("name", ["caldas", "feddrop"])
@pytest.mark.parametrize("model_name", ["resnet18_narrow", "vit_small"])
def test_dropout_methods_refuse_residual_models_in_one_line(name, model_name):
    # Both read a layer's kept inputs from its input_layer's dropout, which a residual stream does not follow.
    from fedjax_sparse.models import make_model
    model = make_model(model_name, (32, 32, 3), 10, **({"width": 4} if model_name == "resnet18_narrow" else {}))
    task = Task(model=model, num_clients=4, clients_per_round=2, local_epochs=1, batch_size=8, lr=0.1, rounds=1,
                preprocess=lambda x: x, seed=0)
    # vit_small is refused first for its attention products outside any weight layer (Model.other_macs).
    with pytest.raises(ValueError, match=f"{model_name} (is not sequential.*sequential --model|computes \\d+ "
                                         "multiply-accumulates per example outside its weight layers)"):
        make_algorithm(name, task, {})
