"""FSL / Sparse-FSL: supermasks, rank arithmetic (the paper's Figure 1), attack, engine runs."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.mechanisms import supermask as sm
from fedjax_sparse.algorithms import ServerContext, Task, make_algorithm
from fedjax_sparse.mechanisms.attacks import reverse_attack
from fedjax_sparse.core.engine import Engine
from fedjax_sparse.models import Conv, Dense, Flatten, sequential

from helpers import hand_accuracies, tiny_federated

# Figure 1: three clients, six edges. Client rankings (least -> most important).
R1 = [4, 0, 2, 3, 5, 1]
R2 = [2, 0, 1, 5, 4, 3]
R3 = [0, 2, 5, 3, 4, 1]


# ---------------------------------------------------------------- rank arithmetic
@pytest.mark.fast
def test_vote_reproduces_figure_1():
    rankings = jnp.array([R1, R2, R3], jnp.int32)
    reps = jax.vmap(sm.reputations)(rankings)
    # "the final total reputations for edges e0..e5 are A = [2, 12, 3, 11, 8, 9]"
    np.testing.assert_array_equal(reps.sum(0), [2, 12, 3, 11, 8, 9])
    np.testing.assert_array_equal(sm.vote(rankings), np.argsort([2, 12, 3, 11, 8, 9], kind="stable"))
    np.testing.assert_array_equal(sm.vote(rankings), [0, 2, 4, 5, 3, 1])


def test_sparse_vote_figure_1_top_half():
    # C1 sends [3, 5, 1]: reputations e3=3, e5=4, e1=5, all others 0.
    np.testing.assert_array_equal(sm.sparse_reputations(jnp.array([3, 5, 1]), 6), [0, 5, 0, 3, 0, 4])
    tops = jnp.array([r[3:] for r in (R1, R2, R3)], jnp.int32)
    np.testing.assert_array_equal(tops, sm.top_of_ranking(jnp.array([R1, R2, R3]), 0.5))
    # by hand: e0=0, e1=5+0+5, e2=0, e3=3+5+3, e4=0+4+4, e5=4+3+0 -> A = [0, 10, 0, 11, 8, 7]
    np.testing.assert_array_equal(sm.vote_sparse(tops, 6), np.argsort([0, 10, 0, 11, 8, 7], kind="stable"))


@pytest.mark.fast
def test_reorder_scores_figure_1():
    # Seed scores [0.5, 0.2, 0.3, 0.4, 0.7, 1.2], global ranking [2, 3, 0, 5, 1, 4]:
    # "edge e4 should get the highest score (1.2), and edge e2 the lowest (0.2)".
    seed_scores = jnp.array([0.5, 0.2, 0.3, 0.4, 0.7, 1.2])
    out = sm.reorder_scores(jnp.sort(seed_scores), jnp.array([2, 3, 0, 5, 1, 4]))
    np.testing.assert_allclose(out, [0.4, 0.7, 0.2, 0.3, 1.2, 0.5])
    np.testing.assert_array_equal(sm.ranking(out), [2, 3, 0, 5, 1, 4])


def test_reorder_round_trip_and_permutations():
    scores = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 5))
    r = sm.ranking(scores)
    assert sorted(np.asarray(r).tolist()) == list(range(60))          # a permutation
    assert r.dtype == jnp.int32
    np.testing.assert_array_equal(sm.reorder_scores(jnp.sort(scores.reshape(-1)), r), scores.reshape(-1))
    rankings = jnp.stack([jax.random.permutation(jax.random.PRNGKey(i), 60) for i in range(5)])
    assert sorted(np.asarray(sm.vote(rankings)).tolist()) == list(range(60))
    np.testing.assert_array_equal(sm.reputations(r)[r], np.arange(60))   # inverse permutation


def test_argsort_callback_matches_jnp_stable_with_ties():
    ints = jnp.array([[3, 1, 3, 0, 1, 3], [2, 2, -2, 2, 1, 1 << 20]], jnp.int32)
    floats = jnp.array([[0.0, -0.0, 1.0, -1.0, 0.0, -2.5], [3e38, -3e38, 1e-40, -1e-40, 2.0, 2.0]])
    for x in (ints, floats):
        want = jnp.argsort(x, axis=-1, stable=True)   # XLA's sort, used off the CPU
        np.testing.assert_array_equal(jax.jit(sm.argsort)(x), want)
        np.testing.assert_array_equal(jax.jit(jax.vmap(sm.argsort))(x), want)
        np.testing.assert_array_equal(jax.jit(lambda a: jax.lax.map(sm.argsort, a))(x), want)
    big = jax.random.normal(jax.random.PRNGKey(0), (70000,)).round(2)   # many ties, both 16-bit halves used
    np.testing.assert_array_equal(sm.argsort(big), jnp.argsort(big, stable=True))


# ---------------------------------------------------------------- masks
def test_topk_mask_keeps_edge_popup_count_and_largest():
    x = jax.random.normal(jax.random.PRNGKey(1), (7, 11))
    for fraction in (0.1, 0.5, 0.9):
        m = np.asarray(sm.topk_mask(x, fraction))
        kept = 77 - int((1 - fraction) * 77)
        assert m.sum() == kept == sm.kept_count(77, fraction)
        order = np.argsort(np.asarray(x).reshape(-1))
        np.testing.assert_array_equal(m.reshape(-1)[order], (np.arange(77) >= 77 - kept).astype(np.float32))


@pytest.mark.parametrize("jit", [False, True])   # under jit XLA folded order_keys' former ``x + 0.0``
def test_topk_mask_ties_signed_values_and_zero(jit):
    topk = jax.jit(sm.topk_mask, static_argnums=1) if jit else sm.topk_mask
    np.testing.assert_array_equal(topk(jnp.array([1., 1., 1., 0., 2.]), 0.6), [1, 1, 0, 0, 1])
    np.testing.assert_array_equal(topk(jnp.array([-3., -1., -2., 0.5]), 0.5), [0, 1, 0, 1])
    np.testing.assert_array_equal(topk(jnp.array([-0.0, 0.0, -1e-30]), 0.2), [1, 0, 0])  # equal zeros
    np.testing.assert_array_equal(topk(jnp.array([-0.0, 0.0, -1e-30]), 0.34), [1, 1, 0])
    np.testing.assert_array_equal(topk(jnp.array([0.0, -0.0, -1e-30]), 0.2), [1, 0, 0])


def _cumsum_lengths(jaxpr) -> list[int]:
    """The length of the scanned axis of every cumsum in ``jaxpr`` and the jaxprs it calls."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cumsum":
            out.append(eqn.invars[0].aval.shape[eqn.params["axis"]])
        for sub in jax.core.jaxprs_in_params(eqn.params):
            out += _cumsum_lengths(sub)
    return out


def test_topk_ties_under_vmap_are_broken_per_client_without_a_prefix_count_over_the_layer():
    """Clients in lockstep: one needs its ties broken (three equal values, room for two), the others do
    not; each gets its own mask as alone. Ties are cut by counts per block of ``TIE_BLOCK`` entries:
    no cumsum runs over the layer (it ran every step of every client)."""
    x = jnp.array([[1., 1., 1., 0., 2.], [3., 1., 2., 0.5, 0.1], [0., 0., 0., 0., 0.]])
    alone = np.stack([np.asarray(sm.topk_mask(row, 0.6)) for row in x])
    np.testing.assert_array_equal(alone, [[1, 1, 0, 0, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    batched = jax.jit(jax.vmap(lambda v: sm.topk_mask(v, 0.6)))
    np.testing.assert_array_equal(batched(x), alone)
    np.testing.assert_array_equal(batched(x[1:2]), alone[1:2])                       # no tie anywhere
    np.testing.assert_array_equal(jax.vmap(jax.vmap(lambda v: sm.topk_mask(v, 0.6)))(x[None]), alone[None])
    for n in (5000, 70000):
        lengths = _cumsum_lengths(jax.make_jaxpr(jax.vmap(lambda v: sm.topk_mask(v, 0.6)))(jnp.ones((4, n))).jaxpr)
        assert lengths and max(lengths) <= max(sm.TIE_BLOCK, 1 << 16), lengths   # blocks and the 65536-bin histograms


def _reference_topk(values: np.ndarray, fraction: float) -> np.ndarray:
    """The kept_count largest values, ties by lowest flat index: a stable sort on (-value, index)."""
    flat = values.reshape(-1)
    kept = sm.kept_count(flat.size, fraction)
    order = np.lexsort((np.arange(flat.size), -(flat.astype(np.float64) + 0.0)))   # -0.0 ties +0.0
    mask = np.zeros(flat.size, np.float32)
    mask[order[:kept]] = 1
    return mask.reshape(values.shape)


@pytest.mark.parametrize("n", [3000, 70001, 1 << 17])   # bisect path; radix path, n not a multiple of TIE_BLOCK
def test_topk_mask_block_tie_cut_matches_a_sort_per_client(n):
    """Many ties, spread over blocks, the threshold's ties cut at various places: each client's mask under
    vmap equals a stable sort's, and the nonnegative keys of |x| give the mask of order_keys."""
    key = jax.random.PRNGKey(n)
    rows = [jax.random.normal(key, (n,)).round(1),                        # ties everywhere
            jnp.zeros((n,)).at[::7].set(1.0),                              # the cut lands inside one block
            jnp.zeros((n,)).at[n // 3:].set(2.0).at[-5:].set(3.0),         # ties in the last blocks only
            jax.random.normal(jax.random.fold_in(key, 1), (n,))]           # no tie
    x = jnp.stack(rows)
    for fraction in (0.5, 0.1, 0.93):
        got = np.asarray(jax.jit(jax.vmap(lambda v: sm.topk_mask(v, fraction)))(x))
        want = np.stack([_reference_topk(np.asarray(r), fraction) for r in rows])
        np.testing.assert_array_equal(got, want)
        absolute = jnp.abs(x)
        np.testing.assert_array_equal(jax.vmap(lambda v: sm.topk_mask(v, fraction, nonnegative=True))(absolute),
                                      np.stack([_reference_topk(np.asarray(r), fraction) for r in absolute]))


def test_straight_through_gradient():
    w = jnp.array([1.0, -2.0, 3.0, 0.5])
    x = jnp.array([2.0, 1.0, -1.0, 4.0])
    s = jnp.array([0.3, -0.9, 0.1, -0.2])

    def f(scores, mask_by):
        return jnp.sum(w * sm.supermask(scores, 0.5, mask_by) * x)
    # raw: top 2 of s are edges 0, 2; the gradient is w*x for every edge (identity STE)
    np.testing.assert_allclose(f(s, "raw"), 1 * 2 + 3 * -1)
    np.testing.assert_allclose(jax.grad(f)(s, "raw"), w * x)
    # abs: top 2 of |s| are edges 1, 0; the gradient flows through |s|: sign(s) * w * x
    np.testing.assert_allclose(f(s, "abs"), 1 * 2 + -2 * 1)
    np.testing.assert_allclose(jax.grad(f)(s, "abs"), np.sign(s) * w * x)


def test_mask_from_ranking_is_top_of_reordered_scores():
    scores = jax.random.uniform(jax.random.PRNGKey(2), (50,))
    ranking = jax.random.permutation(jax.random.PRNGKey(3), 50)
    reordered = sm.reorder_scores(jnp.sort(scores), ranking)
    np.testing.assert_array_equal(sm.mask_from_ranking(ranking, 0.3), sm.topk_mask(reordered, 0.3))


def test_supernet_from_seed():
    shapes = {"conv": (3, 3, 2, 4), "fc": (8, 5)}
    w1, s1 = sm.supernet_from_seed(jax.random.PRNGKey(7), shapes)
    w2, s2 = jax.jit(lambda key: sm.supernet_from_seed(key, shapes))(jax.random.PRNGKey(7))   # inside jit too
    for name, shape in shapes.items():
        fan_in = math.prod(shape[:-1])
        np.testing.assert_array_equal(w1[name], w2[name])
        np.testing.assert_array_equal(s1[name], s2[name])
        np.testing.assert_allclose(np.abs(w1[name]), math.sqrt(2 / fan_in), rtol=1e-6)   # signed constant
        assert 0 < (np.asarray(w1[name]) > 0).mean() < 1
        assert np.abs(s1[name]).max() <= 1 / math.sqrt(fan_in)
    w3, _ = sm.supernet_from_seed(jax.random.PRNGKey(7), shapes, "kaiming_normal")
    assert len(np.unique(np.abs(np.asarray(w3["fc"])))) > 1


# ---------------------------------------------------------------- attack
def test_reverse_attack_reverses_the_malicious_vote():
    messages = {"layer": jnp.array([R1, R2, R3], jnp.int32)}
    is_mal = jnp.array([True, True, False])
    out = reverse_attack(messages, {"layer": 6}, is_mal, is_mal, 1.0)["layer"]
    # VOTE(R1, R2): reputations [1,5,2,3,0,4] + [1,2,0,5,4,3] = [2,7,2,8,4,7] -> [0,2,4,1,5,3]
    np.testing.assert_array_equal(out[0], [3, 5, 1, 4, 2, 0])
    np.testing.assert_array_equal(out[1], [3, 5, 1, 4, 2, 0])
    np.testing.assert_array_equal(out[2], R3)
    # one malicious client alone submits its own ranking reversed
    alone = reverse_attack(messages, {"layer": 6}, jnp.array([False, False, True]),
                           jnp.array([False, False, True]), 1.0)["layer"]
    np.testing.assert_array_equal(alone[2], R3[::-1])
    # Sparse-FSL: the top half of the reversed aggregate, i.e. the aggregate's bottom half reversed
    tops = {"layer": jnp.array([r[3:] for r in (R1, R2, R3)], jnp.int32)}
    sparse = reverse_attack(tops, {"layer": 6}, jnp.array([False, False, True]),
                            jnp.array([False, False, True]), 0.5)["layer"]
    agg = np.asarray(sm.vote_sparse(tops["layer"][2:], 6))
    np.testing.assert_array_equal(sparse[2], agg[:3][::-1])


# ---------------------------------------------------------------- engine runs
def tiny_model(shape, classes):
    return sequential("tiny_supernet", shape, classes, [
        Conv("conv1", 4, 3, padding="SAME", pool=2), Flatten(), Dense("fc1", classes, relu=False)])


def make_task(model, data, clients=6, per_round=6, lr=0.1):
    return Task(model=model, num_clients=clients, clients_per_round=per_round, local_epochs=1, batch_size=8, lr=lr,
                rounds=2, preprocess=data.preprocess, seed=0)


@pytest.fixture(scope="module")
def tiny():
    _, data = tiny_federated()
    return data, tiny_model(data.input_shape, data.num_classes)


def test_sfsl_engine_run_with_attack(tiny):
    """Sparse-FSL (top 10 %), raw-score masks, 2 of 6 clients malicious: accounting and invariants."""
    data, model = tiny
    options = {"upload_fraction": 0.1, "malicious_fraction": 0.34, "mask_by": "raw"}
    alg = make_algorithm("sfsl", make_task(model, data), options)
    engine = Engine(alg, 6, 6)
    state = engine.init(jax.random.PRNGKey(0))
    state, metrics = engine.run_rounds(state, data, 2)
    sizes = [layer.num_weights for layer in model.layers]
    fraction = alg.hparams["upload_fraction"]
    np.testing.assert_allclose(metrics["uplink_bits"], 6 * sm.ranking_bits(sizes, fraction))
    np.testing.assert_allclose(metrics["downlink_bits"], 6 * sm.ranking_bits(sizes))
    assert np.isfinite(metrics["loss"]).all()
    for layer, r in state.server.ranking.items():
        assert sorted(np.asarray(r).tolist()) == list(range(r.shape[0]))
    np.testing.assert_array_equal(metrics["server_malicious_clients"], [2, 2])
    ev = engine.evaluate(state, data)
    per_client, glob = hand_accuracies(alg, state, data)   # the voted global subnetwork, counted by hand
    assert ev["global_accuracy"] == pytest.approx(glob)
    np.testing.assert_allclose(ev["client_accuracies"], per_client)
    assert ev["accuracy"] == pytest.approx(per_client.mean())


def test_fsl_learns(tiny):
    data, model = tiny
    engine = Engine(make_algorithm("fsl", make_task(model, data)), 6, 6)
    state = engine.init(jax.random.PRNGKey(0))
    before = engine.evaluate(state, data)["accuracy"]
    state, _ = engine.run_rounds(state, data, 3)
    assert engine.evaluate(state, data)["accuracy"] > before + 0.2   # the voted subnetwork beats the random one


def test_client_reorders_by_global_ranking_and_server_votes(tiny):
    """One client with lr 0: its upload is the global ranking itself; the server
    vote of identical rankings returns it unchanged."""
    data, model = tiny
    task = make_task(model, data, lr=1e-30)
    alg = make_algorithm("fsl", task, {"weight_decay": 0.0})
    server, clients = alg.init(jax.random.PRNGKey(1))
    ranking = {k: jax.random.permutation(jax.random.PRNGKey(i), v.shape[0]).astype(jnp.int32)
               for i, (k, v) in enumerate(server.ranking.items())}
    payload = alg.broadcast(server._replace(ranking=ranking), jnp.int32(0))
    from fedjax_sparse.core.algorithm import ClientContext
    from fedjax_sparse.data.federated import ClientData
    cdata = ClientData(data.train_x, data.train_y, data.train_idx[0], data.train_count[0])
    ctx = ClientContext(jnp.int32(0), jnp.int32(0), jax.random.PRNGKey(0), jax.random.PRNGKey(1))
    _, message, _ = jax.jit(alg.client_update)(payload, (), cdata, ctx)
    jax.tree_util.tree_map(np.testing.assert_array_equal, message, ranking)
    stacked = jax.tree_util.tree_map(lambda r: jnp.stack([r, r, r]), message)
    sctx = ServerContext(jnp.int32(0), jnp.array([0, 1, 2]), jnp.ones(3), jax.random.PRNGKey(0))
    new_server, _ = alg.server_update(server._replace(ranking=ranking), stacked, sctx)
    jax.tree_util.tree_map(np.testing.assert_array_equal, new_server.ranking, ranking)


def test_rejects_models_with_biases(tiny):
    data, _ = tiny
    biased = sequential("biased", data.input_shape, data.num_classes,
                        [Flatten(), Dense("fc", data.num_classes, bias=True, relu=False)])
    with pytest.raises(ValueError, match="biases"):
        make_algorithm("fsl", make_task(biased, data))
