"""FedDrop / UniDrop: server similarity, keep-probability optimiser, aggregation, end to end."""
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms import ServerContext, Task, make_algorithm
from fedjax_sparse.algorithms.feddrop_family import (channel_trajectories, dropout_objective, dropout_objective_and_grad,
                                              feasible_start, normalise_similarity, optimise_keep_probs,
                                              shift_to_psd, trajectory_similarity)
from fedjax_sparse.core.algorithm import ClientContext
from fedjax_sparse.data.federated import ClientData, build_federated_data
from fedjax_sparse.mechanisms.syncdrop import ChannelLayout, SparseFlopsModel
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models.base import Conv, Dense, Flatten, sequential

from helpers import hand_accuracies


def tiny_model():
    return sequential("tiny", (8, 8, 1), 3, [Conv("conv1", 4, 3, padding="SAME", bias=True, pool=2),
                                             Conv("conv2", 6, 3, bias=True), Flatten(),
                                             Dense("fc", 3, bias=True, relu=False)])


def tiny_data(num_clients=4):
    rng = np.random.default_rng(0)
    n = 12 * num_clients
    ds = SimpleNamespace(train_x=rng.integers(0, 255, (n, 8, 8, 1), dtype=np.uint8),
                         train_y=rng.integers(0, 3, n).astype(np.int32),
                         test_x=rng.integers(0, 255, (24, 8, 8, 1), dtype=np.uint8),
                         test_y=rng.integers(0, 3, 24).astype(np.int32), num_classes=3)
    part = SimpleNamespace(train_indices=[np.arange(i * 12, i * 12 + 12 - 2 * i) for i in range(num_clients)],
                           test_indices=[np.arange(i * 6, i * 6 + 6) for i in range(num_clients)],
                           test_from_train=False)
    return build_federated_data(ds, part)


def tiny_task(data, clients_per_round=3):
    return Task(model=tiny_model(), num_clients=data.num_clients, clients_per_round=clients_per_round,
                local_epochs=1, batch_size=4, lr=0.05, rounds=2, preprocess=data.preprocess)


def run_optimiser(sim, start, flops, **options):
    """optimise_keep_probs, jitted as a whole (eager dispatch compiles op by op)."""
    return jax.jit(functools.partial(optimise_keep_probs, flops=flops, **options))(sim, start)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def random_psd(key, channels, clients, rank=3):
    g = jax.random.normal(key, (channels, clients, rank))
    return normalise_similarity(jnp.einsum("nkr,nlr->nkl", g, g))


def flops_model():
    model = tiny_model()
    layout = ChannelLayout.from_model(model)
    return layout, SparseFlopsModel.build(model, layout)


# ---------------------------------------------------------------- similarity
@pytest.mark.fast
def test_trajectory_similarity_matches_the_definition():
    model = tiny_model()
    layout = ChannelLayout.from_model(model)
    rng = np.random.default_rng(0)
    shapes = {l.name: {"kernel": l.kernel_shape, "bias": (l.out_units,)} for l in model.layers}
    old = jax.tree_util.tree_map(lambda shape: rng.normal(size=shape).astype(np.float32), shapes,
                                 is_leaf=lambda x: isinstance(x, tuple))
    new = jax.tree_util.tree_map(lambda x: (x[None] + 0.1 * rng.normal(size=(2,) + x.shape)).astype(np.float32), old)
    shares = np.array([0.25, 0.75], np.float32)
    probs = rng.uniform(0.3, 1.0, (2, layout.total)).astype(np.float32)
    sim = jax.jit(lambda o, nw, s, p: trajectory_similarity(channel_trajectories(model, layout, o, nw),
                                                            layout, s, p))(old, new, shares, probs)
    assert sim.shape == (layout.total, 2, 2)
    n = layout.offsets[1] + 2  # channel 2 of conv2
    d = [np.concatenate([np.asarray(old["conv2"]["kernel"][..., 2] - new["conv2"]["kernel"][k, ..., 2]).ravel(),
                         [float(old["conv2"]["bias"][2] - new["conv2"]["bias"][k, 2])]]) for k in range(2)]
    for i in range(2):
        for j in range(2):
            expected = shares[i] * shares[j] * max(probs[i, n], probs[j, n]) * d[i] @ d[j]
            assert float(sim[n, i, j]) == pytest.approx(float(expected), rel=1e-4)


def test_psd_shift_and_normalisation():
    s = np.random.default_rng(0).normal(size=(5, 4, 4)).astype(np.float32)
    s = s + np.swapaxes(s, 1, 2)
    psd = random_psd(jax.random.PRNGKey(1), 5, 4)

    @jax.jit
    def check(s, psd):
        shifted = shift_to_psd(s, "always")
        return (jnp.linalg.eigvalsh(shifted)[:, 0], shift_to_psd(psd, "negative"),
                normalise_similarity(shifted).sum())
    smallest, psd_shifted, total = check(s, psd)
    assert np.linalg.eigvalsh(s)[:, 0].max() < -0.1  # the input is indefinite
    np.testing.assert_allclose(smallest, 0.0, atol=1e-5)  # smallest eigenvalue moved to 0
    np.testing.assert_allclose(psd_shifted, psd, atol=1e-6)  # already PSD: untouched
    assert float(total) == pytest.approx(1.0, rel=1e-5)


# ---------------------------------------------------------------- optimiser
@pytest.mark.fast
def test_analytic_objective_gradient_matches_autodiff():
    sim = random_psd(jax.random.PRNGKey(0), 10, 4)
    x = 1.0 + jax.random.uniform(jax.random.PRNGKey(1), (4, 10)) * 3
    x = x.at[1, :3].set(x[0, :3])  # a few ties
    value, grad = jax.jit(dropout_objective_and_grad)(x, sim)
    auto_value, auto_grad = jax.jit(jax.value_and_grad(dropout_objective))(x, sim)
    assert float(value) == pytest.approx(float(auto_value), rel=1e-5)
    np.testing.assert_allclose(grad, auto_grad, rtol=1e-4, atol=1e-6)


def test_optimiser_reduces_the_objective_within_the_budget():
    layout, flops = flops_model()
    clients, budget = 4, 0.5
    sim = random_psd(jax.random.PRNGKey(3), layout.total, clients)
    p0 = jnp.full((clients, layout.total), flops.uniform_keep_prob(budget))
    q, info = run_optimiser(sim, p0, flops, budget=budget, mu=1e-4, max_iters=2000, check_every=200)
    assert bool(jnp.all(jnp.isfinite(q)))
    assert float(info.loss_end) < float(info.loss_start)
    assert float(info.objective_end) < float(info.objective_start)
    assert float(info.slack) > 0 and float(flops.budget_slack(q, budget)) > 0
    assert float(q.min()) >= 0.01 - 1e-6 and float(q.max()) <= 1.0
    # The budget binds: q is not all ones but uses (almost) all of it.
    assert float(flops.ratio(q).mean()) > 0.45


def test_optimiser_without_budget_keeps_everything():
    # Thm. 3: without the FLOPs constraint eq. (7) is minimised at q = 1.
    # A full-rank S makes q = 1 the unique minimiser (a rank-deficient one has flat directions).
    layout, flops = flops_model()
    sim = random_psd(jax.random.PRNGKey(4), layout.total, 4, rank=12)
    start = jax.random.uniform(jax.random.PRNGKey(5), (4, layout.total), minval=0.3, maxval=0.9)
    q, info = run_optimiser(sim, start, flops, budget=None, max_iters=3000, check_every=500, tol=1e-7)
    np.testing.assert_allclose(q, 1.0, atol=1e-2)
    assert float(info.objective_end) == pytest.approx(float(sim.sum()), rel=1e-3)  # = sum S at q = 1


def test_optimiser_backs_off_from_nan_and_infeasible_steps():
    layout, flops = flops_model()
    sim = random_psd(jax.random.PRNGKey(6), layout.total, 3)
    p0 = jnp.full((3, layout.total), flops.uniform_keep_prob(0.4))
    q, info = run_optimiser(sim, p0, flops, budget=0.4, lr=1e4, max_iters=300, check_every=100)
    assert int(info.rejected) > 0  # huge steps leave the feasible set and get halved
    assert bool(jnp.all(jnp.isfinite(q))) and float(flops.budget_slack(q, 0.4)) > 0
    assert float(info.loss_end) <= float(info.loss_start)


def test_feasible_start_moves_into_the_interior():
    layout, flops = flops_model()
    on_boundary = jnp.full((3, layout.total), flops.uniform_keep_prob(0.5))
    above = jnp.ones((3, layout.total))
    for p in (on_boundary, above):
        start = feasible_start(p, flops, 0.5, min_keep=0.01)
        assert float(flops.budget_slack(start, 0.5)) > 0
        assert bool(jnp.all(start <= p + 1e-7))
    inside = jnp.full((3, layout.total), flops.uniform_keep_prob(0.3))
    np.testing.assert_allclose(feasible_start(inside, flops, 0.5, 0.01), inside)


# ---------------------------------------------------------------- algorithm
@pytest.fixture(scope="module")
def setup():
    """Tiny data, a 4-client task (3 per round) and FedDrop built once (compiles are the cost here)."""
    data = tiny_data()
    task = tiny_task(data)
    alg = make_algorithm("feddrop", task, {"budget": 0.4, "opt_iters": 100, "opt_check_every": 20})
    server, _ = jax.jit(alg.init)(jax.random.PRNGKey(0))
    return SimpleNamespace(data=data, task=task, alg=alg, server=server)


def test_server_averages_by_data_size_and_updates_only_the_sampled_clients(setup):
    alg, server = setup.alg, setup.server
    a = jax.tree_util.tree_map(lambda x: x + 1.0, server.variables)
    b = jax.tree_util.tree_map(lambda x: x - 3.0, server.variables)
    c = jax.tree_util.tree_map(lambda x: x + 0.5, server.variables)
    messages = {"variables": jax.tree_util.tree_map(lambda u, v, w: jnp.stack([u, v, w]), a, b, c),
                "sampled_flops": jnp.array([1.0, 2.0, 3.0])}
    ctx = ServerContext(jnp.int32(0), jnp.array([3, 1, 0], jnp.int32), jnp.array([1.0, 3.0, 4.0]),
                        jax.random.PRNGKey(1))
    new, metrics = jax.jit(alg.server_update)(server, messages, ctx)
    expected = jax.tree_util.tree_map(lambda o: o + 0.125 * 1.0 + 0.375 * -3.0 + 0.5 * 0.5, server.variables)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5),
                           new.variables, expected)
    untouched, sampled = jnp.array([2]), jnp.array([0, 1, 3])
    np.testing.assert_allclose(new.keep_probs[untouched], server.keep_probs[untouched])
    assert not np.allclose(new.keep_probs[sampled], server.keep_probs[sampled])
    assert float(metrics["sampled_flops"]) == 6.0


def test_client_uses_its_own_keep_probs_and_accounts_for_them(setup):
    data, alg, server = setup.data, setup.alg, setup.server
    layout, flops = flops_model()
    probs = server.keep_probs.at[2].set(jnp.linspace(0.2, 1.0, layout.total))
    payload = alg.broadcast(server._replace(keep_probs=probs), jnp.int32(0))
    client = ClientData(data.train_x, data.train_y, data.train_idx[2], data.train_count[2])
    ctx = ClientContext(jnp.int32(0), jnp.int32(2), jax.random.PRNGKey(1), jax.random.PRNGKey(2))
    _, message, metrics = jax.jit(alg.client_update)(payload, (), client, ctx)
    examples = int(data.train_count[2])
    assert float(metrics["flops"]) == pytest.approx(3 * float(flops.forward(probs[2])) * examples, rel=1e-5)
    model_bits = 32 * sum(x.size for x in jax.tree_util.tree_leaves(server.variables))
    assert float(metrics["uplink_bits"]) == model_bits
    assert float(metrics["downlink_bits"]) == model_bits + 32 * layout.total
    assert float(metrics["density"]) == pytest.approx(float(probs[2].mean()), rel=1e-5)
    # Sampled FLOPs lie between the all-dropped and the dense count.
    dense = 3 * flops.dense_total * examples
    assert 0 < float(message["sampled_flops"]) <= dense
    assert alg.hparams["initial_keep_prob"] == pytest.approx(flops.uniform_keep_prob(0.4))


@pytest.mark.parametrize("name", ["feddrop", "unidrop"])
def test_two_rounds_end_to_end(setup, name):
    data, task = setup.data, setup.task
    alg = setup.alg if name == "feddrop" else make_algorithm(name, task, {"budget": 0.4})
    engine = Engine(alg, task.num_clients, task.clients_per_round)
    state, metrics = engine.run_rounds(engine.init(jax.random.PRNGKey(0)), data, 2)
    for key, value in metrics.items():
        assert bool(jnp.all(jnp.isfinite(value))), key
    p0 = alg.hparams["initial_keep_prob"]
    assert float(metrics["flops_ratio"][0]) == pytest.approx(0.4, abs=1e-4)
    if name == "feddrop":
        assert float(metrics["downlink_bits"][0]) > float(metrics["uplink_bits"][0])
        assert bool(jnp.all(metrics["server_budget_slack"] > 0))
        assert not np.allclose(state.server.keep_probs, p0)
    else:
        np.testing.assert_allclose(state.server.keep_probs, p0)
        assert float(metrics["downlink_bits"][0]) == float(metrics["uplink_bits"][0])
    # Random labels: nothing to learn, so the reference is a hand count of the global model's hits.
    evaluation = engine.evaluate(state, data)
    per_client, glob = hand_accuracies(alg, state, data)
    assert evaluation["global_accuracy"] == pytest.approx(glob)
    np.testing.assert_allclose(evaluation["client_accuracies"], per_client)


# ---------------------------------------------------------------- models
@pytest.mark.parametrize("name, shape, params, flops", [
    # Tables 6-8: parameters, and per conv "FLOPs" = MACs + ReLU outputs (3 significant digits).
    ("feddrop_fmnist_cnn", (28, 28, 1), 226e3, [652e3, 10.0e6, 923e3]),
    ("feddrop_svhn_cnn", (32, 32, 3), 227e3, [1.91e6, 5.13e6, 333e3]),
    ("feddrop_vgg9", (32, 32, 3), 1.53e6, [918e3, 18.9e6, 18.9e6, 37.8e6, 18.9e6, 37.8e6]),
])
@pytest.mark.fast
def test_models_match_the_papers_tables(name, shape, params, flops):
    from fedjax_sparse.models import make_model
    model = make_model(name, shape, 10)
    count = sum(l.num_weights + l.out_units for l in model.layers)  # kernels + biases
    assert count == pytest.approx(params, rel=5e-3)
    convs = [l for l in model.layers if l.kind == "conv"]
    table = [l.macs + l.macs // l.fan_in for l in convs]
    np.testing.assert_allclose(table, flops, rtol=5e-3)


def test_overlapping_average_pool_is_adaptive_pooling_to_2x2():
    from fedjax_sparse.models.layers import avg_pool
    x = np.random.default_rng(0).normal(size=(2, 5, 5, 3)).astype(np.float32)
    for size, window, stride in ((5, 3, 2), (3, 2, 1)):
        xs = x[:, :size, :size]
        # PyTorch AdaptiveAvgPool2d(2): window i covers [floor(i n / 2), ceil((i + 1) n / 2)).
        bounds = [(i * size // 2, -(-(i + 1) * size // 2)) for i in range(2)]
        expected = np.stack([np.stack([xs[:, a:b, c:d].mean((1, 2)) for c, d in bounds], 1) for a, b in bounds], 1)
        np.testing.assert_allclose(avg_pool(jnp.asarray(xs), window, stride), expected, rtol=1e-5, atol=1e-6)
