"""Every parameterised product of a Flax model is seen (issue 41 item 2).

The layer table holds Dense, Conv (grouped/depthwise too), DenseGeneral (attention's projections),
Einsum, Embed and the Dense layers inside recurrent cells, linen and nnx; MACs come from the traced
program (every dot and convolution, scans times their length), so FedAvg's FLOPs equal a hand count,
attention's score and value products included. Each mechanism either acts on a layer kind or refuses
the run in one line naming the layer (docs/design.md: layer kind x mechanism).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax import nnx

from fedjax_sparse.core import accounting
from fedjax_sparse.algorithms.spafl_family import init_thresholds, make_setup, row_masks
from fedjax_sparse.core.algorithm import Task
from fedjax_sparse.algorithms.registry import make_algorithm
from fedjax_sparse.mechanisms import threshold_masks as masks
from fedjax_sparse.models.flax.adapter import einsum_out_axes, from_flax


# ------------------------------------------------------------------ models written with Flax's own layers
class TinyViT(nn.Module):
    """Patch-embedding conv, class token and positions, one pre-norm block (attention + MLP), class head."""
    patch: int = 4
    dim: int = 16
    heads: int = 2
    mlp: int = 32
    classes: int = 3

    @nn.compact
    def __call__(self, x):
        b = x.shape[0]
        x = nn.Conv(self.dim, (self.patch, self.patch), strides=self.patch, padding="VALID")(x)
        x = x.reshape(b, -1, self.dim)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, self.dim))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)), x], axis=1)
        x = x + self.param("pos", nn.initializers.normal(0.02), (x.shape[1], self.dim))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(self.mlp)(nn.LayerNorm()(x)))
        x = x + nn.Dense(self.dim)(h)
        return nn.Dense(self.classes)(nn.LayerNorm()(x[:, 0]))


class TinyText(nn.Module):
    """Token ids (carried as floats) -> Embed -> self-attention -> Dense per token -> mean -> head;
    bias-free, so FSL (every weight a supernetwork edge) takes it too."""
    vocab: int = 50
    dim: int = 16
    heads: int = 2
    classes: int = 3

    @nn.compact
    def __call__(self, x):
        ids = jnp.abs(x * 10).astype(jnp.int32) % self.vocab
        h = nn.Embed(self.vocab, self.dim)(ids)
        h = h + nn.SelfAttention(num_heads=self.heads, use_bias=False)(h)
        h = nn.relu(nn.Dense(self.dim, use_bias=False)(h))
        return nn.Dense(self.classes, use_bias=False)(h.mean(axis=1))


class LSTMClassifier(nn.Module):
    hidden: int = 8
    classes: int = 3

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.LSTMCell(self.hidden))(x)
        return nn.Dense(self.classes)(h[:, -1])


class GroupedConvs(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(8, (3, 3), feature_group_count=8)(x))     # depthwise
        x = nn.relu(nn.Conv(16, (3, 3), feature_group_count=4)(x))    # grouped
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


class NnxBlock(nnx.Module):
    """nnx's own layers: Conv patches, Embed positions, MultiHeadAttention (LinearGeneral inside), Einsum."""

    def __init__(self, rngs):
        self.patch = nnx.Conv(3, 16, (4, 4), strides=4, padding="VALID", rngs=rngs)
        self.pos = nnx.Embed(4, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)
        self.mix = nnx.Einsum("btd,dnh->btnh", (16, 2, 4), rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        x = self.patch(x).reshape(x.shape[0], -1, 16)
        x = x + self.pos(jnp.arange(x.shape[1]))[None]
        x = x + self.attn(self.norm(x))
        return self.head(self.mix(x).reshape(x.shape[0], x.shape[1], 8).mean(axis=1))


@pytest.fixture(scope="module")
def vit():
    return from_flax(TinyViT(), (8, 8, 3))


@pytest.fixture(scope="module")
def text():
    return from_flax(TinyText(), (6,))


def _task(model):
    return Task(model=model, num_clients=2, clients_per_round=2, local_epochs=1, batch_size=4, lr=0.1, rounds=1,
                preprocess=lambda x: x)


# ------------------------------------------------------------------ MACs: hand counts from the shapes
def test_a_tiny_vit_costs_its_hand_count_attention_products_included(vit):
    patches, tokens, p, c, d, heads, mlp, classes = 4, 5, 4, 3, 16, 2, 32, 3
    head_dim = d // heads
    patch_embed = patches * (p * p * c) * d
    qkv = 3 * tokens * d * (heads * head_dim)
    scores = values = heads * tokens * tokens * head_dim        # q.k^T and attention-weights . v
    out = tokens * (heads * head_dim) * d
    block_mlp = tokens * d * mlp + tokens * mlp * d
    head = d * classes
    hand = patch_embed + qkv + scores + values + out + block_mlp + head
    assert vit.forward_macs == hand == 14160
    assert vit.other_macs == scores + values
    kinds = {layer.name: layer.kind for layer in vit.layers}
    assert kinds == {"Conv_0": "conv", "MultiHeadDotProductAttention_0/query": "dense_general",
                     "MultiHeadDotProductAttention_0/key": "dense_general",
                     "MultiHeadDotProductAttention_0/value": "dense_general",
                     "MultiHeadDotProductAttention_0/out": "dense_general",
                     "Dense_0": "dense", "Dense_1": "dense", "Dense_2": "dense"}
    query = vit.layer("MultiHeadDotProductAttention_0/query")
    assert (query.kernel_shape, query.out_axes, query.out_units, query.fan_in, query.macs) == \
        ((d, heads, head_dim), 2, heads * head_dim, d, tokens * d * heads * head_dim)
    # FedAvg's FLOPs per example: 3 x 2 x the hand count.
    assert accounting.training_flops_per_example(vit) == 6 * hand


def test_a_small_text_transformer_costs_its_hand_count_and_its_embedding_is_a_layer(text):
    tokens, d, heads, vocab, classes = 6, 16, 2, 50, 3
    head_dim = d // heads
    hand = (3 * tokens * d * d                      # query, key, value projections
            + 2 * heads * tokens * tokens * head_dim  # scores and values
            + tokens * d * d                          # output projection
            + tokens * d * d                          # Dense per token
            + d * classes)                            # head
    assert text.forward_macs == hand == 8880
    embed = text.layer("Embed_0")
    assert (embed.kind, embed.kernel_shape, embed.in_units, embed.out_units, embed.macs) == \
        ("embed", (vocab, d), vocab, d, 0)
    variables = text.init(jax.random.PRNGKey(0))
    assert set(variables["params"]["Embed_0"]) == {"kernel"}   # the table, under the name every mechanism reads
    # Hooks act on the table: zeroing it changes the logits.
    x = jnp.arange(12, dtype=jnp.float32).reshape(2, 6) / 10
    zero = lambda name, k: jnp.zeros_like(k) if name == "Embed_0" else k  # noqa: E731
    from fedjax_sparse.models.base import Hooks
    assert not np.allclose(text.apply(variables, x)[0], text.apply(variables, x, hooks=Hooks(kernel=zero))[0])


def test_an_lstm_classifier_counts_every_step_of_its_cell():
    steps, features, hidden, classes = 5, 4, 8, 3
    model = from_flax(LSTMClassifier(), (steps, features))
    cell = {layer.name: layer for layer in model.layers if layer.kind == "recurrent"}
    assert sorted(cell) == [f"LSTMCell_0/{g}" for g in ("hf", "hg", "hi", "ho", "if", "ig", "ii", "io")]
    assert cell["LSTMCell_0/ii"].macs == steps * features * hidden
    assert cell["LSTMCell_0/hi"].macs == steps * hidden * hidden
    assert model.forward_macs == steps * 4 * (features * hidden + hidden * hidden) + hidden * classes
    assert not model.sequential


@pytest.fixture(scope="module")
def grouped():
    return from_flax(GroupedConvs(), (6, 6, 2))


def test_grouped_and_depthwise_convolutions_count_in_over_groups(grouped):
    h = w = 6
    model = grouped
    macs = [layer.macs for layer in model.layers]
    assert macs == [h * w * 9 * 2 * 8, h * w * 9 * (8 // 8) * 8, h * w * 9 * (8 // 4) * 16, h * w * 16 * 3]
    assert [layer.in_units for layer in model.layers[:3]] == [2, 8, 8]
    assert model.other_macs == 0


def test_nnx_linear_general_attention_einsum_and_embed_are_layers():
    model = from_flax(NnxBlock(nnx.Rngs(0)), (8, 8, 3))
    tokens, d, heads, head_dim = 4, 16, 2, 8
    kinds = {layer.name: layer.kind for layer in model.layers}
    assert kinds == {"patch": "conv", "pos": "embed", "attn/query": "dense_general", "attn/key": "dense_general",
                     "attn/value": "dense_general", "attn/out": "dense_general", "mix": "einsum", "head": "dense"}
    hand = (tokens * 48 * d + 3 * tokens * d * d + 2 * heads * tokens * tokens * head_dim + tokens * d * d
            + tokens * d * 8 + 8 * 3)
    assert model.forward_macs == hand
    assert model.layer("mix").out_axes == 2 and model.layer("mix").out_units == 8
    # The position table is looked up at constant indices: its output is still a layer's output, read by q/k/v.
    assert model.layer("attn/query").input_layer == "pos"


def test_einsum_rows_are_the_kernels_trailing_output_axes():
    assert einsum_out_axes("btd,dnh->btnh") == 2
    assert einsum_out_axes("btd,dh->bth") == 1
    assert einsum_out_axes("bnd,ndh->bnh") == 0     # n is shared with the input: no rows
    assert einsum_out_axes("btd,hd->bth") == 0      # the output axis is not the kernel's last


# ------------------------------------------------------------------ each mechanism acts on each kind, or refuses
def test_spafl_thresholds_every_layer_of_a_transformer_one_threshold_per_output_unit(text):
    setup = make_setup(text, {})
    assert [layer.name for layer in setup.layers] == [layer.name for layer in text.layers]
    tau = init_thresholds(setup.layers)
    assert tau["SelfAttention_0/query"].shape == (16,)         # heads x head_dim units
    # Raising one unit's threshold prunes exactly that unit's incoming weights kernel[:, h, j].
    params = text.init(jax.random.PRNGKey(0))["params"]
    tau["SelfAttention_0/query"] = tau["SelfAttention_0/query"].at[5].set(1e3)
    mask = row_masks(params, tau)["SelfAttention_0/query"]
    kernel = masks.apply_row_mask(params["SelfAttention_0/query"]["kernel"], mask)
    assert float(jnp.abs(kernel[:, 0, 5]).sum()) == 0.0
    assert int((jnp.abs(kernel).sum(axis=0) > 0).sum()) == 15
    # With every row kept, SpaFL's per-row FLOPs plus the attention products are FedAvg's.
    rows = sum(r * layer.out_units for r, layer in zip(accounting.row_training_flops(text), text.layers))
    assert rows + 6 * text.other_macs == accounting.training_flops_per_example(text)


def test_spafl_books_attention_products_in_a_run_as_fedavg_does(text):
    """One round on a toy text task: with thresholds at 0 every row is kept, so SpaFL's FLOPs (kept rows x
    per-row FLOPs, plus the products outside the weight layers) are FedAvg's, 6 x forward MACs x examples."""
    import fedjax_sparse as fjs
    rng = np.random.default_rng(0)
    x, y = rng.random((24, 6), np.float32), rng.integers(0, 3, 24).astype(np.int32)
    data = fjs.data.from_arrays(x[:16], y[:16], x[16:], y[16:], partition="iid", num_clients=2, seed=0)
    flops = {}
    for algorithm in ("fedavg", "spafl"):
        config = fjs.RunConfig(algorithm=algorithm, rounds=1, clients_per_round=2, local_epochs=1, batch_size=8,
                               lr=0.05, preprocess="raw")
        rows = []
        fjs.run(config, model=text, data=data, progress=False, on_eval=lambda row, state, exp: rows.append(row))
        flops[algorithm] = rows[-1]["flops"]
    assert flops["spafl"] == flops["fedavg"] == 6 * text.forward_macs * 16


def test_fedpm_and_fsl_mask_every_weight_layer(text):
    names = {layer.name for layer in text.layers}
    server, _ = make_algorithm("fedpm", _task(text)).init(jax.random.PRNGKey(0))
    assert set(server.probs) == names
    assert server.probs["Embed_0"].shape == (50, 16)
    server, _ = make_algorithm("fsl", _task(text)).init(jax.random.PRNGKey(0))
    assert set(server.weights) == names


@pytest.mark.parametrize("algorithm,options", [
    ("feddrop", {}), ("unidrop", {}), ("caldas", {}), ("heterofl", {"sliced": False}), ("fjord", {"sliced": False}),
])
def test_unit_dropping_mechanisms_refuse_what_they_cannot_drop_in_one_line(text, algorithm, options):
    with pytest.raises(ValueError) as error:
        make_algorithm(algorithm, _task(text), options)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{algorithm}: layer Embed_0 ") and "'embed'" in message


@pytest.mark.parametrize("algorithm,options", [("feddrop", {}), ("heterofl", {"sliced": False})])
def test_channel_pairing_mechanisms_refuse_a_depthwise_convolution_in_one_line(grouped, algorithm, options):
    with pytest.raises(ValueError, match=rf"^{algorithm}: layer Conv_1 .* is a grouped convolution") as error:
        make_algorithm(algorithm, _task(grouped), options)
    assert "\n" not in str(error.value)


def test_spafl_refuses_an_einsum_without_rows_in_one_line():
    class PerHead(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Einsum((4, 8, 3), "bnd,ndh->bnh")(x)
            return nn.Dense(3)(h.reshape(h.shape[0], -1))
    class CallTimeSpec(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Einsum((8, 2, 3))(x, "btd,dnh->btnh")
            return nn.Dense(3)(h.reshape(h.shape[0], -1))
    model = from_flax(PerHead(), (4, 8))
    assert model.layer("Einsum_0").out_axes == 0
    rows = from_flax(CallTimeSpec(), (4, 8)).layer("Einsum_0")   # the spec given at call time counts too
    assert (rows.out_axes, rows.out_units, rows.macs) == (2, 6, 4 * 8 * 6)
    with pytest.raises(ValueError, match=r"^spafl: layer Einsum_0 .* has no output rows") as error:
        make_setup(model, {})
    assert "\n" not in str(error.value)


def test_a_kernel_no_layer_multiplies_by_is_refused_not_left_out():
    class Upsample(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.ConvTranspose(4, (2, 2), strides=(2, 2))(x)
            return nn.Dense(3)(x.reshape(x.shape[0], -1))
    with pytest.raises(ValueError, match=r"params entry ConvTranspose_0 holds a kernel") as error:
        from_flax(Upsample(), (4, 4, 1))
    assert "\n" not in str(error.value)


def test_an_nnx_rnn_counts_every_step_as_linen_does():
    """Refused before issue 47 (its nnx.scan runs copies of the cell); the copies now carry their paths."""
    class NnxRecurrent(nnx.Module):
        def __init__(self, rngs):
            self.rnn = nnx.RNN(nnx.LSTMCell(4, 8, rngs=rngs))
            self.head = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.rnn(x)[:, -1])
    model = from_flax(NnxRecurrent(nnx.Rngs(0)), (5, 4))
    assert {layer.kind for layer in model.layers} == {"recurrent", "dense"}
    assert model.forward_macs == from_flax(LSTMClassifier(), (5, 4)).forward_macs == 1944


def test_pytorch_weights_are_not_converted_into_an_embedding_or_attention_layout(text):
    from fedjax_sparse.errors import PinningError
    from fedjax_sparse.driver.pinning import params_from_torch
    with pytest.raises(PinningError, match=r"^Embed_0: a layer of kind .embed. .* dense and conv layers only"):
        params_from_torch(text, {"emb.weight": np.zeros((50, 16), np.float32)}, names={"Embed_0": "emb"})
