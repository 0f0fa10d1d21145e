"""SyncDrop, the sparse FLOPs model and the dropout-aware init (fedjax_sparse.mechanisms.syncdrop)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.mechanisms.syncdrop import (ChannelLayout, SparseFlopsModel, channel_scale_hooks, channel_uniforms,
                                   dropout_aware_init, dropout_scale, keep_mask, solve_scaling, syncdrop)
from fedjax_sparse.models import make_model
from fedjax_sparse.models.base import Conv, Dense, Flatten, sequential

DRAWS = 20000


def two_layer_net():
    """conv 1->4 3x3 VALID on 6x6 (-> 4x4x4), flatten 64, dense 64->3."""
    return sequential("two_layer", (6, 6, 1), 3, [Conv("conv", 4, 3), Flatten(), Dense("fc", 3, relu=False)])


def draws(key, layout, steps=DRAWS):
    return jax.vmap(lambda s: channel_uniforms(key, s, layout))(jnp.arange(steps))


@pytest.mark.fast
def test_syncdrop_pairs_are_correlated_as_min_of_keep_probs():
    # E[d_i d_j] = min(p_i, p_j) (eq. 4) with shared draws; independent draws give p_i p_j.
    layout = ChannelLayout(("a", "b"), (3, 3))
    p_i = jnp.array([0.2, 0.5, 0.9, 0.7, 0.3, 1.0])
    p_j = jnp.array([0.6, 0.5, 0.4, 0.1, 0.8, 0.05])
    u = draws(jax.random.PRNGKey(1), layout)
    d_i, d_j = keep_mask(u, p_i), keep_mask(u, p_j)
    joint = np.asarray((d_i * d_j).mean(0))
    target = np.minimum(p_i, p_j)
    se = np.sqrt(target * (1 - target) / DRAWS) + 1e-9
    assert np.all(np.abs(joint - target) <= 4 * se + 1e-6), (joint, target)
    np.testing.assert_allclose(d_i.mean(0), p_i, atol=0.015)
    # Without synchronisation the pair is independent: E = p_i p_j.
    u_other = draws(jax.random.PRNGKey(2), layout)
    indep = np.asarray((d_i * keep_mask(u_other, p_j)).mean(0))
    np.testing.assert_allclose(indep, p_i * p_j, atol=0.015)
    assert (target - p_i * p_j).max() > 0.2  # so the first check can tell the two apart


def test_clients_in_one_vmap_share_draws_but_keep_their_own_probs():
    layout = ChannelLayout(("a",), (64,))
    shared = jax.random.PRNGKey(3)
    probs = jnp.stack([jnp.full((64,), 0.3), jnp.full((64,), 0.7), jnp.linspace(0.0, 1.0, 64)])

    def client(p, step):
        return keep_mask(channel_uniforms(shared, step, layout), p)
    masks = jax.vmap(client, in_axes=(0, None))(probs, 5)
    # Same draws: the kept set of the smaller probability is a subset of the larger's.
    assert bool(jnp.all(masks[0] <= masks[1]))
    u = channel_uniforms(shared, 5, layout)
    np.testing.assert_array_equal(masks[2], (u < probs[2]).astype(np.float32))
    # Another step draws afresh.
    assert not bool(jnp.all(channel_uniforms(shared, 6, layout) == u))


def test_inverted_scaling_keeps_the_expected_activation():
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 3, 4))
    p = jnp.array([0.25, 0.5, 0.8, 1.0])
    layout = ChannelLayout(("a",), (4,))
    u = draws(jax.random.PRNGKey(4), layout)
    mean = jax.vmap(lambda uu: syncdrop(h, p, uu))(u).mean(0)
    # Per element: std of the estimate is |h| sqrt((1-p)/p / DRAWS).
    tol = 5 * jnp.abs(h) * jnp.sqrt((1 - p) / p / DRAWS) + 1e-6
    assert bool(jnp.all(jnp.abs(mean - h) <= tol))
    # A dropped channel is exactly zero, a kept one exactly h / p.
    out = syncdrop(h, p, jnp.array([0.3, 0.3, 0.9, 0.99]))
    np.testing.assert_allclose(out[..., 0], 0.0)
    np.testing.assert_allclose(out[..., 1], h[..., 1] / 0.5, rtol=1e-6)
    np.testing.assert_allclose(out[..., 2], 0.0)
    np.testing.assert_allclose(out[..., 3], h[..., 3], rtol=1e-6)


def test_hooks_drop_only_layout_channels_and_evaluation_is_dense():
    model = two_layer_net()
    variables = model.init(jax.random.PRNGKey(0))
    x = jax.random.uniform(jax.random.PRNGKey(1), (2, 6, 6, 1))
    layout = ChannelLayout.from_model(model)
    assert layout.names == ("conv",) and layout.total == 4
    scales = jnp.array([0.0, 2.0, 0.0, 1.0])
    out, _ = model.apply(variables, x, train=True, hooks=channel_scale_hooks(layout, scales))
    kernel = variables["params"]["conv"]["kernel"]
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, kernel, (1, 1), "VALID",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC")))
    expected = (h * scales).reshape(2, -1) @ variables["params"]["fc"]["kernel"]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    dense, _ = model.apply(variables, x, train=False)
    np.testing.assert_allclose(dense, h.reshape(2, -1) @ variables["params"]["fc"]["kernel"], rtol=1e-5, atol=1e-5)


def test_flops_model_matches_a_hand_count():
    model = two_layer_net()
    layout = ChannelLayout.from_model(model)
    p = jnp.array([1.0, 0.5, 0.5, 0.0])  # mean 0.5
    # conv: 4*4 outputs * 9 taps * 1 in * 4 out = 576 MACs = 1152 FLOPs; fc: 64*3 = 192 MACs = 384 FLOPs.
    paper = SparseFlopsModel.build(model, layout)
    assert paper.dense_total == 1152 + 384
    assert float(paper.forward(p)) == pytest.approx(1152 * 0.5 + 384 * 0.5)  # fc inputs are dropped too
    fixed_dense = SparseFlopsModel.build(model, layout, input_sparsity_in_dense=False)
    assert float(fixed_dense.forward(p)) == pytest.approx(1152 * 0.5 + 384)
    with_relu = SparseFlopsModel.build(model, layout, count_activations=True)
    # eq. 9's activation term: 2 * (kept output elements): 2 * 64 * 0.5 for conv, 2 * 3 for fc.
    assert float(with_relu.forward(p)) == pytest.approx(1152 * 0.5 + 64 + 384 * 0.5 + 6)
    mask = jnp.array([1.0, 0.0, 0.0, 1.0])
    assert float(paper.forward_of_mask(mask)) == pytest.approx(768.0)


@pytest.mark.fast
def test_initial_keep_prob_solves_the_budget_quadratic():
    # Two convs and a dense layer: ratio(p) = (F1 p + F2 p^2 + F3 p) / F, quadratic in p.
    model = sequential("q", (6, 6, 1), 2, [Conv("c1", 3, 3, padding="SAME"), Conv("c2", 5, 3), Flatten(),
                                           Dense("fc", 2, relu=False)])
    layout = ChannelLayout.from_model(model)
    flops = SparseFlopsModel.build(model, layout)
    f1, f2, f3 = (2.0 * l.macs for l in model.layers)
    for r in (0.25, 1 / 3, 0.5, 0.9):
        lo, hi = 0.0, 1.0  # independent bisection on the hand formula
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if (f1 * mid + f2 * mid ** 2 + f3 * mid) / (f1 + f2 + f3) < r else (lo, mid)
        p0 = flops.uniform_keep_prob(r)
        assert p0 == pytest.approx(lo, abs=1e-5)
        assert float(flops.ratio(jnp.full((layout.total,), p0))) == pytest.approx(r, abs=1e-5)
    assert flops.uniform_keep_prob(1.0) == 1.0
    fixed = SparseFlopsModel.build(model, layout, input_sparsity_in_dense=False)
    with pytest.raises(ValueError, match="unattainable"):
        fixed.uniform_keep_prob(0.9 * f3 / (f1 + f2 + f3))


def test_mean_sampled_flops_converge_to_the_expected_count():
    # App. D.5: the FLOPs of drawn masks average to the expected FLOPs (eq. 10).
    model = make_model("feddrop_fmnist_cnn", (28, 28, 1), 10)
    layout = ChannelLayout.from_model(model)
    flops = SparseFlopsModel.build(model, layout)
    p = jax.random.uniform(jax.random.PRNGKey(0), (layout.total,), minval=0.2, maxval=1.0)
    u = draws(jax.random.PRNGKey(5), layout)
    sampled = jax.vmap(lambda uu: flops.forward_of_mask(keep_mask(uu, p)))(u)
    expected = float(flops.forward(p))
    errors = [abs(float(sampled[:n].mean()) / expected - 1) for n in (100, DRAWS)]
    se = float(sampled.std()) / math.sqrt(DRAWS) / expected
    assert errors[1] <= 4 * se and errors[1] < 2e-3, (errors, se)
    assert errors[1] < errors[0] or errors[0] < 2e-3


@pytest.mark.parametrize("scheme", ["paper", "reference", "model"])
def test_modified_he_init_has_variance_2p_over_fan_in(scheme):
    model = make_model("feddrop_fmnist_cnn", (28, 28, 1), 10)
    layout = ChannelLayout.from_model(model)
    base = model.init(jax.random.PRNGKey(0))
    variables = dropout_aware_init(jax.random.PRNGKey(1), base, model, layout, 0.6, scheme)
    for layer in model.layers:
        kernel = np.asarray(variables["params"][layer.name]["kernel"])
        changed = (layer.kind == "conv" and scheme != "model") or (scheme == "reference" and layer.name == "fc1")
        if changed:
            assert kernel.var() == pytest.approx(2 * 0.6 / layer.fan_in, rel=0.1), layer.name
            if scheme == "reference":
                assert np.abs(kernel).max() <= math.sqrt(6 * 0.6 / layer.fan_in)
        else:
            np.testing.assert_array_equal(kernel, base["params"][layer.name]["kernel"])


def test_scaling_coefficients_give_the_mean_ratio_of_scaled_probabilities():
    """mean_k ratio(s p_k) = a s^2 + b s + c for any s, with per-client, per-channel
    p: the conv fed by a conv is quadratic in s, the first conv and the dense layer
    fed by dropped channels are linear (plus the activation terms), and a dense
    layer fed by a dense one is constant."""
    model = sequential("q", (6, 6, 1), 2, [Conv("c1", 3, 3, padding="SAME"), Conv("c2", 5, 3), Flatten(),
                                           Dense("fc1", 4), Dense("fc2", 2, relu=False)])
    layout = ChannelLayout.from_model(model)
    # By hand with per-layer constant p (0.5 on c1, 0.8 on c2): fc1 sees c2's channels, fc2 sees none dropped.
    f1, f2, f3, f4 = (2.0 * l.macs for l in model.layers)
    flat = jnp.concatenate([jnp.full((3,), 0.5), jnp.full((5,), 0.8)])
    assert float(SparseFlopsModel.build(model, layout).forward(flat)) == pytest.approx(
        f1 * 0.5 + f2 * 0.5 * 0.8 + f3 * 0.8 + f4, rel=1e-6)
    p = jax.random.uniform(jax.random.PRNGKey(0), (3, layout.total), minval=0.1, maxval=1.0)
    # Batched over clients = one client at a time.
    flops = SparseFlopsModel.build(model, layout)
    np.testing.assert_allclose(flops.forward(p), [float(flops.forward(p[k])) for k in range(3)], rtol=1e-6)
    for activations in (False, True):
        flops = SparseFlopsModel.build(model, layout, count_activations=activations)
        a, b, c = (float(v) for v in flops.scaling_coefficients(p))
        assert a > 0 and b > 0 and c > 0
        for s in (0.3, 0.8, 1.7):
            want = float(flops.ratio(s * p).mean())
            assert a * s * s + b * s + c == pytest.approx(want, rel=1e-5), (activations, s)
        # g(p) = r - mean_k ratio(p_k) (eq. 5), and the scaling s solving a s^2 + b s + c = r meets it exactly.
        assert float(flops.budget_slack(p, 0.6)) == pytest.approx(0.6 - (a + b + c), rel=1e-5)
        s = float(solve_scaling(a, b, c, 0.4))
        assert float(flops.budget_slack(s * p, 0.4)) == pytest.approx(0.0, abs=1e-6)


def test_solve_scaling_and_budgets_of_one_or_more():
    assert float(solve_scaling(1.0, 2.0, 0.5, 3.5)) == pytest.approx(1.0)   # s^2 + 2 s + 0.5 = 3.5
    assert float(solve_scaling(0.0, 0.5, 0.25, 0.5)) == pytest.approx(0.5)  # linear: 0.5 s + 0.25 = 0.5
    flops = SparseFlopsModel.build(two_layer_net(), ChannelLayout.from_model(two_layer_net()))
    assert flops.uniform_keep_prob(1.5) == 1.0   # a budget of the dense cost or more drops nothing
    # A budget equal to the cost of the layers without dropout (c) would need p = 0: unattainable.
    fixed = SparseFlopsModel.build(two_layer_net(), ChannelLayout.from_model(two_layer_net()),
                                   input_sparsity_in_dense=False)
    _, _, c = (float(v) for v in fixed.scaling_coefficients(jnp.ones((1, 4))))
    assert c == pytest.approx(384 / 1536)
    with pytest.raises(ValueError, match="unattainable"):
        fixed.uniform_keep_prob(c)


def test_scale_defaults_to_inverted_dropout_and_hooks_keep_the_activation_dtype():
    mask, p = jnp.array([1.0, 0.0, 1.0]), jnp.array([0.5, 0.5, 0.25])
    np.testing.assert_allclose(dropout_scale(mask, p), [2.0, 0.0, 4.0])          # d / p by default
    np.testing.assert_allclose(dropout_scale(mask, p, rescale=False), mask)
    h = jnp.full((2, 3), 3.0)
    np.testing.assert_allclose(syncdrop(h, p, jnp.array([0.1, 0.9, 0.2])), [[6, 0, 12]] * 2)
    np.testing.assert_allclose(syncdrop(h, p, jnp.array([0.1, 0.9, 0.2]), rescale=False), [[3, 0, 3]] * 2)
    layout = ChannelLayout(("conv",), (3,))
    hooks = channel_scale_hooks(layout, dropout_scale(mask, p))
    h = jnp.ones((2, 3), jnp.bfloat16)
    out = hooks.activation("conv", h)
    assert out.dtype == jnp.bfloat16   # float32 scales do not promote bfloat16 activations
    np.testing.assert_array_equal(np.asarray(out, np.float32), [[2, 0, 4], [2, 0, 4]])
    assert hooks.activation("fc", h) is h


@pytest.mark.fast
def test_keep_mask_is_strict_so_p_zero_never_keeps():
    # d = 1[u < p] (eq. 3): a draw of exactly 0 must not keep a channel of keep probability 0.
    np.testing.assert_array_equal(keep_mask(jnp.array([0.0, 0.0, 0.5, 0.5]), jnp.array([0.0, 1.0, 0.5, 0.6])),
                                  [0.0, 1.0, 0.0, 1.0])


def test_dropout_aware_init_defaults_to_the_papers_normal_and_names_bad_schemes():
    """The default scheme is the paper's N(0, 2p/fan_in), told from the reference code's
    uniform of the same variance by its tails: with ~20k entries a normal has values past the
    uniform's bound sqrt(6p/fan_in) (P ~ 8 %) and kurtosis ~ 3 (uniform: 1.8)."""
    model = make_model("feddrop_fmnist_cnn", (28, 28, 1), 10)
    layout = ChannelLayout.from_model(model)
    base = model.init(jax.random.PRNGKey(0))
    default = dropout_aware_init(jax.random.PRNGKey(1), base, model, layout, 0.6)
    layer = max((model.layer(n) for n in layout.names), key=lambda l: math.prod(l.kernel_shape))
    kernel = np.asarray(default["params"][layer.name]["kernel"], np.float64).ravel()
    assert kernel.size > 10000
    z = kernel / math.sqrt(2 * 0.6 / layer.fan_in)
    assert np.mean(z ** 4) == pytest.approx(3.0, abs=0.2)
    assert np.abs(kernel).max() > math.sqrt(6 * 0.6 / layer.fan_in)
    with pytest.raises(ValueError, match="unknown init scheme 'he'"):
        dropout_aware_init(jax.random.PRNGKey(1), base, model, layout, 0.6, "he")


def test_dropout_aware_init_reaches_targets_after_untouched_layers():
    """Dropout on fc1 only (a layout naming just fc1, behind two convs): the convs before it keep
    their kernels and fc1 after them is re-initialised; an all-conv model (no dense layer) with
    the reference scheme re-initialises only its layout's convs."""
    model = sequential("q", (6, 6, 1), 2, [Conv("c1", 3, 3, padding="SAME"), Conv("c2", 5, 3), Flatten(),
                                           Dense("fc1", 4), Dense("fc2", 2, relu=False)])
    layout = ChannelLayout(("fc1",), (4,))
    base = model.init(jax.random.PRNGKey(0))
    out = dropout_aware_init(jax.random.PRNGKey(1), base, model, layout, 0.5)
    for name in ("c1", "c2", "fc2"):
        np.testing.assert_array_equal(out["params"][name]["kernel"], base["params"][name]["kernel"])
    assert not np.array_equal(out["params"]["fc1"]["kernel"], base["params"]["fc1"]["kernel"])
    convs = sequential("allconv", (6, 6, 1), 2, [Conv("c1", 3, 3), Conv("c2", 2, 4), Flatten()])
    conv_layout = ChannelLayout(("c1",), (3,))
    base = convs.init(jax.random.PRNGKey(0))
    out = dropout_aware_init(jax.random.PRNGKey(1), base, convs, conv_layout, 0.5, "reference")
    np.testing.assert_array_equal(out["params"]["c2"]["kernel"], base["params"]["c2"]["kernel"])
    assert not np.array_equal(out["params"]["c1"]["kernel"], base["params"]["c1"]["kernel"])
