"""Tests that pin mechanisms the rest of the suite left unchecked.

Each test here was written against one specific wrong implementation (a
"mutation" of the package code) and was seen to fail with that mutation in
place; docs/testing.md lists the mutations, the tests that kill them and the
failure each one gave.
"""
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.mechanisms import supermask as sm
from fedjax_sparse.algorithms import ClientContext, Task, make_algorithm
from fedjax_sparse.algorithms.feddrop_family import FEDDROP_OPTIONS, optimise_keep_probs
from fedjax_sparse.algorithms.fsl_family import FSL_OPTIONS
from fedjax_sparse.algorithms.robust import local_lr
from fedjax_sparse.algorithms.spafl_family import SPAFL_OPTIONS
from fedjax_sparse.data.federated import ClientData, build_federated_data
from fedjax_sparse.mechanisms.syncdrop import ChannelLayout, SparseFlopsModel
from fedjax_sparse.models import make_model
from fedjax_sparse.models.base import Conv, Dense, Flatten, Hooks, sequential
from fedjax_sparse.core.training import masked_cross_entropy

from helpers import tiny_federated


def client_data(data, cid):
    return ClientData(data.train_x, data.train_y, data.train_idx[cid], data.train_count[cid])


def client_examples(data, cid):
    """(x preprocessed, y, count): all of client ``cid``'s training examples as one batch."""
    count = int(data.train_count[cid])
    rows = np.asarray(data.train_idx[cid])[:count]
    return data.preprocess(jnp.asarray(data.train_x[rows])), jnp.asarray(data.train_y[rows]), count


def leaves(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)])


# ============================================================== FedDrop
def feddrop_model():
    return sequential("tiny", (8, 8, 1), 3, [Conv("conv1", 4, 3, padding="SAME", bias=True, pool=2),
                                             Conv("conv2", 6, 3, bias=True), Flatten(),
                                             Dense("fc", 3, bias=True, relu=False)])


@pytest.fixture(scope="module")
def feddrop_setup():
    rng = np.random.default_rng(0)
    n = 48
    ds = SimpleNamespace(train_x=rng.integers(0, 255, (n, 8, 8, 1), dtype=np.uint8),
                         train_y=rng.integers(0, 3, n).astype(np.int32),
                         test_x=rng.integers(0, 255, (8, 8, 8, 1), dtype=np.uint8),
                         test_y=rng.integers(0, 3, 8).astype(np.int32), num_classes=3)
    part = SimpleNamespace(train_indices=[np.arange(i * 12, i * 12 + 12) for i in range(4)],
                           test_indices=[np.arange(i * 2, i * 2 + 2) for i in range(4)], test_from_train=False)
    data = build_federated_data(ds, part)
    task = Task(model=feddrop_model(), num_clients=4, clients_per_round=2, local_epochs=2, batch_size=4,
                lr=0.05, rounds=1, preprocess=data.preprocess)
    return data, task


def drawn_flops(alg, data, private_keys, shared_keys):
    """sampled_flops (a function of the drawn masks only: every step has 4 real
    examples) of client 0's update under each (private, shared) key pair."""
    server, _ = alg.init(jax.random.PRNGKey(0))
    payload = alg.broadcast(server, jnp.int32(0))
    update = jax.jit(alg.client_update)
    out = []
    for private, shared in zip(private_keys, shared_keys):
        ctx = ClientContext(jnp.int32(0), jnp.int32(0), jax.random.PRNGKey(private), jax.random.PRNGKey(shared))
        _, message, _ = update(payload, (), client_data(data, 0), ctx)
        out.append(float(message["sampled_flops"]))
    return out


def test_feddrop_clients_draw_the_rounds_shared_dropout_masks(feddrop_setup):
    """SyncDrop: the masks come from the round's shared key, not the client's
    private one. Clients with the same keep probabilities then drop the same
    channels at every step, so the FLOPs of the drawn masks agree whatever
    the private keys; a different shared key draws different masks."""
    data, task = feddrop_setup
    feddrop = make_algorithm("feddrop", task, {"budget": 0.4, "optimize": False})
    same_shared = drawn_flops(feddrop, data, private_keys=[1, 2, 3], shared_keys=[7, 7, 7])
    assert same_shared[0] == same_shared[1] == same_shared[2], same_shared
    other_shared = drawn_flops(feddrop, data, private_keys=[1, 1, 1], shared_keys=[7, 8, 9])
    assert len(set(other_shared)) > 1, other_shared
    assert FEDDROP_OPTIONS["synchronized"] is True   # SyncDrop is the default


def test_barrier_sign_pushes_keep_probabilities_away_from_the_budget():
    """Eq. (8) is eq. (7) - mu log g(q): the log-barrier *rewards* slack. With a
    zero similarity only the barrier is left, so the optimum is the largest
    slack: every q falls (towards min_keep) and the slack grows; and the
    reported loss at the start is by hand objective - mu * log(slack)."""
    model = feddrop_model()
    layout = ChannelLayout.from_model(model)
    flops = SparseFlopsModel.build(model, layout)
    clients, budget, mu, min_keep = 3, 0.5, 0.1, 0.05
    p0 = jnp.full((clients, layout.total), flops.uniform_keep_prob(budget) * 0.9)
    run = jax.jit(functools.partial(optimise_keep_probs, flops=flops, budget=budget, mu=mu, lr=100.0, max_iters=400,
                                    check_every=100, min_keep=min_keep))
    q, info = run(jnp.zeros((layout.total, clients, clients)), p0)
    slack0 = float(flops.budget_slack(p0, budget))
    assert bool(jnp.all(q < p0 - 1e-3))
    assert float(info.slack) > slack0 + 0.01
    assert float(info.loss_end) == pytest.approx(-mu * np.log(float(info.slack)), rel=1e-4)
    # A PSD similarity: the loss at the start is eq. (7) minus mu log g at the start.
    g = jax.random.normal(jax.random.PRNGKey(0), (layout.total, clients, 2))
    sim = jnp.einsum("nkr,nlr->nkl", g, g)
    sim = sim / sim.sum()
    _, info = run(sim, p0)
    assert float(info.loss_start) == pytest.approx(float(info.objective_start) - mu * np.log(slack0), rel=1e-5)
    assert float(info.loss_end) <= float(info.loss_start)


# ============================================================== FSL
def fsl_model(shape, classes):
    return sequential("tiny_supernet", shape, classes, [
        Conv("conv1", 4, 3, padding="SAME", pool=2), Flatten(), Dense("fc1", classes, relu=False)])


@pytest.fixture(scope="module")
def fsl_setup():
    _, data = tiny_federated()
    return data, fsl_model(data.input_shape, data.num_classes)


def fsl_task(model, data, lr, epochs=1, batch_size=64):
    return Task(model=model, num_clients=6, clients_per_round=6, local_epochs=epochs, batch_size=batch_size,
                lr=lr, rounds=2, preprocess=data.preprocess, seed=0)


def test_supermask_defaults_to_absolute_scores():
    """The authors' code masks by |score|: a large negative score is kept."""
    scores = jnp.array([-5.0, 1.0, 0.5, 2.0, -0.1, 0.2])
    np.testing.assert_array_equal(sm.supermask(scores, 0.5), [1, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(sm.supermask(scores, 0.5, "raw"), [0, 1, 1, 1, 0, 0])
    assert FSL_OPTIONS["mask_by"] == "abs"


def test_fsl_default_masks_by_absolute_score_on_client_and_server(fsl_setup):
    """Default FSL: the server's global kernels are w * top(|reordered scores|),
    and a client's training loss (lr ~ 0, one batch) is the loss of that
    |score|-masked network, not of the raw-score one."""
    data, model = fsl_setup
    alg = make_algorithm("fsl", fsl_task(model, data, lr=1e-30))
    server, _ = alg.init(jax.random.PRNGKey(3))
    fraction = FSL_OPTIONS["subnet_fraction"]

    @jax.jit
    def by_hand(server):
        kernels, differs = {}, {}
        for name, w in server.weights.items():
            scores = sm.reorder_scores(server.sorted_scores[name], server.ranking[name])
            kernels[name] = w * sm.topk_mask(jnp.abs(scores), fraction).reshape(w.shape)
            differs[name] = jnp.any(sm.topk_mask(jnp.abs(scores), fraction) != sm.topk_mask(scores, fraction))
        return kernels, differs
    kernels, differs = by_hand(server)
    for name in kernels:
        assert bool(differs[name])   # |score| and raw score pick different edges here
        np.testing.assert_array_equal(server.kernels[name], kernels[name])
    cid = 2
    ctx = ClientContext(jnp.int32(0), jnp.int32(cid), jax.random.PRNGKey(0), jax.random.PRNGKey(1))
    _, _, metrics = jax.jit(alg.client_update)(alg.broadcast(server, jnp.int32(0)), (), client_data(data, cid), ctx)
    x, y, count = client_examples(data, cid)
    params = {name: {"kernel": k} for name, k in kernels.items()}
    logits, _ = jax.jit(lambda v, x: model.apply(v, x, train=True))({"params": params, "batch_stats": {}}, x)
    want = float(masked_cross_entropy(logits, y, jnp.ones(count)))
    assert float(metrics["loss"]) == pytest.approx(want, rel=1e-5)


def test_fsl_score_update_is_sgd_with_momentum_and_weight_decay(fsl_setup):
    """Two local steps (two epochs of one full batch) by hand:
    buf_1 = g_1 + wd s_0, s_1 = s_0 - lr_1 buf_1;
    buf_2 = m buf_1 + g_2 + wd s_1, s_2 = s_1 - lr_2 buf_2;
    the client uploads argsort(s_2). A large weight decay makes it matter for
    the ranking (one step alone would only rescale the learning rate)."""
    data, model = fsl_setup
    wd, m, base_lr, epochs = 3.0, 0.9, 0.2, 2
    options = {"weight_decay": wd, "momentum": m, "lr_decay": 1.0}
    task = fsl_task(model, data, lr=base_lr, epochs=epochs)
    alg = make_algorithm("fsl", task, options)
    server, _ = alg.init(jax.random.PRNGKey(3))
    cid = 4
    ctx = ClientContext(jnp.int32(0), jnp.int32(cid), jax.random.PRNGKey(0), jax.random.PRNGKey(1))
    _, message, _ = jax.jit(alg.client_update)(alg.broadcast(server, jnp.int32(0)), (), client_data(data, cid), ctx)

    x, y, count = client_examples(data, cid)
    shapes = {name: w.shape for name, w in server.weights.items()}
    params = {name: {"kernel": w} for name, w in server.weights.items()}

    def loss(scores):
        hooks = Hooks(kernel=lambda layer, w: w * sm.supermask(scores[layer], FSL_OPTIONS["subnet_fraction"]))
        logits, _ = model.apply({"params": params, "batch_stats": {}}, x, train=True, hooks=hooks)
        return masked_cross_entropy(logits, y, jnp.ones(count))
    grad = jax.jit(jax.grad(loss))

    def run(weight_decay, momentum):
        s = {n: sm.reorder_scores(server.sorted_scores[n], server.ranking[n]).reshape(shapes[n])
             for n in shapes}
        buf = None
        for step in range(epochs):
            lr = float(local_lr(base_lr, 1.0, 0, jnp.int32(step), jnp.int32(epochs), epochs, "cosine_epoch"))
            g = grad(s)
            u = {n: g[n] + weight_decay * s[n] for n in s}
            buf = u if buf is None else {n: momentum * buf[n] + u[n] for n in s}
            s = {n: s[n] - lr * buf[n] for n in s}
        return {n: np.asarray(sm.ranking(s[n])) for n in s}

    def mismatch(a, b):
        return sum(int((a[n] != np.asarray(b[n])).sum()) for n in a)
    total = sum(int(np.prod(s)) for s in shapes.values())
    want = run(wd, m)
    assert mismatch(want, message) <= total // 50   # float rounding may swap a near-tie or two
    assert mismatch(run(0.0, m), message) > total // 10   # without weight decay: a different ranking
    assert mismatch(run(wd, 0.0), message) > total // 10  # without momentum: a different ranking


# ============================================================== SpaFL
def test_spafl_momentum_persists_across_a_clients_rounds():
    """keep_optimizer_state (default): a client's SGD momentum buffer is part of
    its state and the next round continues it. One full-batch step per round,
    alpha = 0: after round 0 the buffer is g_1 = (w_0 - w_1) / lr; in round 1
    the update with the kept buffer differs from a fresh one by exactly
    -lr * momentum * g_1."""
    _, data = tiny_federated()
    lr = 0.05
    model = make_model("cnn_small", data.input_shape, data.num_classes)
    task = Task(model=model, num_clients=data.num_clients, clients_per_round=2, local_epochs=1, batch_size=64,
                lr=lr, rounds=3, preprocess=data.preprocess)
    alg = make_algorithm("spafl", task, {"alpha": 0.0})
    server, clients = alg.init(jax.random.PRNGKey(0))
    cid = 2
    state0 = jax.tree_util.tree_map(lambda v: v[cid], clients)
    update = jax.jit(alg.client_update)

    def ctx(r):
        return ClientContext(jnp.int32(r), jnp.int32(cid), jax.random.PRNGKey(r), jax.random.PRNGKey(10 + r))
    state1, _, _ = update(server, state0, client_data(data, cid), ctx(0))
    trainable0 = {"params": state0.params, "tau": server.tau}
    trainable1 = {"params": state1.params, "tau": state1.tau}
    g1 = jax.tree_util.tree_map(lambda a, b: (a - b) / lr, trainable0, trainable1)
    assert float(np.abs(leaves(g1)).max()) > 1e-3
    np.testing.assert_allclose(leaves(state1.opt_state), leaves(g1), rtol=1e-3, atol=1e-4)

    fresh = state1._replace(opt_state=jax.tree_util.tree_map(jnp.zeros_like, state1.opt_state))
    kept2, _, _ = update(server, state1, client_data(data, cid), ctx(1))
    fresh2, _, _ = update(server, fresh, client_data(data, cid), ctx(1))
    diff = jax.tree_util.tree_map(jnp.subtract, kept2.params, fresh2.params)
    np.testing.assert_allclose(leaves(diff), -lr * SPAFL_OPTIONS["momentum"] * leaves(g1["params"]),
                               rtol=1e-3, atol=1e-5)
    assert SPAFL_OPTIONS["keep_optimizer_state"] is True   # the FMNIST code's behaviour is the default
