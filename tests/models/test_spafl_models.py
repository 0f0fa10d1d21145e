"""SpaFL's models: threshold/parameter counts from the paper's appendix, costs, structure."""
import jax
import jax.extend  # noqa: F401  (jax.extend.core: not imported by `import jax`)
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sparse.algorithms.spafl_family import num_thresholds, thresholded_layers
from fedjax_sparse.models import Hooks, make_model
from fedjax_sparse.models.flax.program_flow import product_macs
from fedjax_sparse.models.zoo.spafl import _conv_pt, patchify

CIFAR = (32, 32, 3)


def counts(model):
    layers = thresholded_layers(model)
    return num_thresholds(layers), sum(l.num_weights for l in layers)


def leaf_count(tree):
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def _sub_jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def jaxpr_macs(jaxpr, scale: int = 1) -> int:
    """MACs of every dot and convolution of a jaxpr, counted independently of from_flax's program_flow:
    sub-programs recursed into, a scan's body times its length, a cond's largest branch."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "conv_general_dilated"):
            total += scale * product_macs(eqn)
        elif name == "cond":
            total += max((jaxpr_macs(b, scale) for b in _sub_jaxprs(eqn.params["branches"])), default=0)
        else:
            factor = int(eqn.params["length"]) if name == "scan" else 1
            total += sum(jaxpr_macs(sub, scale * factor) for v in eqn.params.values() for sub in _sub_jaxprs(v))
    return total


@pytest.mark.fast
def test_lenet5_caffe_matches_the_paper():
    # Appendix A.1: 430,500 parameters and 580 thresholds.
    model = make_model("lenet5_caffe", (28, 28, 1), 10)
    assert counts(model) == (580, 430_500)
    assert [l.name for l in thresholded_layers(model)] == ["conv1", "conv2", "fc1", "fc2"]


def test_cnn7_counts():
    """Appendix A.1 gives 807,366 parameters: the 804,800 kernel weights plus
    BatchNorm's 640 scales + 640 biases + 1,280 running statistics + PyTorch's
    6 ``num_batches_tracked`` counters. Its 650 thresholds (one per row of the
    7 layers: 64+64+128+128+128+128+10) differ from the paper's 1,418, which is
    the row count of the Conv-6 of Zhou et al. (64,64,128,128,256,256,256,256,10)."""
    model = make_model("cnn7", CIFAR, 10)
    n_tau, n_w = counts(model)
    assert (n_tau, n_w) == (650, 804_800)
    v = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    assert leaf_count(v["params"]) + leaf_count(v["batch_stats"]) + 6 == 807_366
    assert 64 + 64 + 128 + 128 + 256 + 256 + 256 + 256 + 10 == 1418
    assert len(thresholded_layers(model)) == 7


@pytest.mark.parametrize("width,rows,weights", [(32, 2400, 2_790_240), (64, 4800, 11_159_232)])
def test_resnet18_counts(width, rows, weights):
    """width 64 = the paper's appendix (4,800 thresholds, 11,159,232 parameters
    without the classifier); width 32 = the reference code's narrow network."""
    model = make_model("resnet18_narrow", CIFAR, 100, width=width)
    assert counts(model) == (rows, weights)
    names = [l.name for l in thresholded_layers(model)]
    assert "linear" not in names and len(names) == 20  # 1 stem + 16 block convs + 3 shortcuts
    assert [n for n in names if "shortcut" in n] == ["layer2_0_shortcut", "layer3_0_shortcut", "layer4_0_shortcut"]
    # Hand-derived costs: stride-2 3x3 conv of stage 2 on 32->16 maps; its 1x1 shortcut.
    assert model.layer("layer2_0_conv1").macs == 16 * 16 * 9 * width * 2 * width
    assert model.layer("layer2_0_shortcut").macs == 16 * 16 * width * 2 * width
    assert model.layer("linear").macs == 8 * width * 100


def test_vit_small_counts():
    model = make_model("vit_small", CIFAR, 10)
    layers = thresholded_layers(model)
    assert [l.name for l in layers[:4]] == ["block0_qkv", "block0_attn_out", "block0_mlp1", "block0_mlp2"]
    per_block_rows = 3 * 8 * 64 + 128 + 256 + 128
    per_block_weights = 128 * 1536 + 512 * 128 + 128 * 256 + 256 * 128
    assert counts(model) == (6 * per_block_rows, 6 * per_block_weights) == (12_288, 1_966_080)
    assert model.layer("block0_qkv").macs == 65 * 128 * 1536  # 64 patches + CLS token
    assert {l.name for l in model.layers} - {l.name for l in layers} == {"patch_embed", "head"}


def test_pytorch_style_padding_of_strided_convs():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 8, 2))
    k = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 2, 3))
    want = jax.lax.conv_general_dilated(x, k, (2, 2), ((1, 1), (1, 1)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    for impl in ("im2col", "xla"):
        np.testing.assert_allclose(_conv_pt(x, k, 2, impl), want, rtol=1e-5, atol=1e-5)


def cheap_variables(model, seed=0):
    """Variables of the model's shapes without running its (slow to compile) init:
    BatchNorm/LayerNorm at identity, running stats (0, 1), other leaves N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)
    ones, zeros = ("var", "bn_scale", "scale"), ("mean", "bn_bias", "bias")

    def fill(path, leaf):
        name = path[-1].key
        if name in ones:
            return jnp.ones(leaf.shape, leaf.dtype)
        if name in zeros and name != "bias":
            return jnp.zeros(leaf.shape, leaf.dtype)
        return jnp.asarray(rng.normal(0, 0.1, leaf.shape), leaf.dtype)
    return jax.tree_util.tree_map_with_path(fill, jax.eval_shape(model.init, jax.random.PRNGKey(0)))


def zero_kernels(selected):
    return Hooks(kernel=lambda name, k: jnp.zeros_like(k) if selected(name) else k)


def test_resnet_residual_structure():
    """Zeroing every block's second conv and every shortcut conv cuts the path
    from the input at stage 2, so the logits are the classifier bias for any
    image; zeroing only the second convs keeps the identity paths."""
    model = make_model("resnet18_narrow", CIFAR, 7, width=4, conv_impl="xla")  # fast to compile
    v = cheap_variables(model)
    x = jax.random.normal(jax.random.PRNGKey(1), (3,) + CIFAR)

    @jax.jit
    def both(v, x):
        cut = zero_kernels(lambda n: n.endswith(("_conv2", "_shortcut")))
        keep_identity = zero_kernels(lambda n: n.endswith("_conv2"))
        return model.apply(v, x, hooks=cut)[0], model.apply(v, x, train=True, hooks=keep_identity)

    logits_cut, (logits, stats) = both(v, x)
    np.testing.assert_allclose(logits_cut, np.broadcast_to(v["params"]["linear"]["bias"], (3, 7)), atol=1e-6)
    assert logits.shape == (3, 7) and float(jnp.abs(logits[0] - logits[1]).max()) > 1e-4
    assert set(stats) == set(v["batch_stats"])


def test_vit_residual_structure_and_cls_pooling():
    """With attention-out and MLP-out rows all pruned, every block is the
    identity, and CLS pooling sees only the CLS token + its position
    embedding: the logits no longer depend on the image."""
    model = make_model("vit_small", CIFAR, 5, depth=2)
    v = cheap_variables(model)
    x = jax.random.normal(jax.random.PRNGKey(1), (2,) + CIFAR)
    pruned = zero_kernels(lambda n: n.endswith(("attn_out", "mlp2")))
    logits, full = jax.jit(lambda v, x: (model.apply(v, x, hooks=pruned)[0], model.apply(v, x)[0]))(v, x)
    p = v["params"]
    z = p["embedding"]["cls"] + p["embedding"]["pos"][0]
    z = (z - z.mean()) / jnp.sqrt(z.var() + 1e-5) * p["head_ln"]["scale"] + p["head_ln"]["bias"]
    want = z @ p["head"]["kernel"] + p["head"]["bias"]
    np.testing.assert_allclose(logits, np.broadcast_to(want, (2, 5)), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(full[0] - full[1]).max()) > 1e-4


@pytest.mark.fast
def test_vit_patchify_matches_a_naive_loop():
    """Token t = patch (t // 2, t % 2) of a 2x2 grid, flattened as (p1, p2, c)."""
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
    got = np.asarray(patchify(jnp.asarray(x), 4))
    want = np.zeros((2, 4, 48), np.float32)
    for t in range(4):
        r, c = divmod(t, 2)
        for p1 in range(4):
            for p2 in range(4):
                for ch in range(3):
                    want[:, t, (p1 * 4 + p2) * 3 + ch] = x[:, 4 * r + p1, 4 * c + p2, ch]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, shape, classes", [
    ("lenet5_caffe", (28, 28, 1), 10), ("cnn7", (32, 32, 3), 10), ("resnet18_narrow", (32, 32, 3), 100),
    ("vit_small", (32, 32, 3), 10), ("feddrop_vgg9", (32, 32, 3), 10), ("fsl_lenet", (28, 28, 1), 10),
    ("mlp", (28, 28, 1), 10), ("cnn_small", (8, 8, 1), 10)])
def test_the_zoos_hand_written_macs_equal_the_traced_programs(name, shape, classes):
    # Every dot and convolution of one example's forward pass (batch 2 minus batch 1), counted from the traced
    # program: the zoo's hand-written tables (and vit_small's attention products, Model.other_macs) must match.
    model = make_model(name, shape, classes)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0))

    def macs(batch):
        x = jax.ShapeDtypeStruct((batch,) + shape, jnp.float32)
        return jaxpr_macs(jax.make_jaxpr(lambda v, x: model.apply(v, x)[0])(variables, x).jaxpr)
    assert model.forward_macs == macs(2) - macs(1)
