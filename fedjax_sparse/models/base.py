"""The model abstraction every algorithm works with (docs/design.md, "Models and hooks").

A :class:`Model` is its weight layers (:class:`LayerInfo`, with their MACs per example) and two pure
functions: ``init(key) -> variables``, ``variables = {"params": {layer: {...}}, "batch_stats": {layer:
{"mean", "var"}}}`` where each weight layer owns ``params[name]["kernel"]`` (HWIO or [in, out]) and
optionally ``"bias"``, ``"bn_scale"``, ``"bn_bias"``; and ``apply(variables, x, *, train, hooks, sample_mask,
rng) -> (logits, batch_stats)``. Algorithms change a model without touching it through :class:`Hooks`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from fedjax_sparse.errors import arg
from fedjax_sparse.models import layers as L

Variables = dict
_identity_kernel = lambda name, kernel: kernel  # noqa: E731
_identity_activation = lambda name, h: h  # noqa: E731


@dataclasses.dataclass(frozen=True)
class Hooks:
    """How an algorithm changes a model without touching it: ``kernel(name, kernel)`` returns the
    kernel a weight layer uses (SpaFL's threshold mask, FSL's supermask); ``activation(name, h)``
    transforms a layer's output ``h [B, ..., channels]`` (FedDrop's SyncDrop, width masks). Plain callables
    closed over traced arrays: they compose with jit/vmap/grad."""
    kernel: Callable[[str, jax.Array], jax.Array] = _identity_kernel
    activation: Callable[[str, jax.Array], jax.Array] = _identity_activation


NO_HOOKS = Hooks()


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One weight layer. ``macs``: multiply-accumulates per sample (forward).

    ``in_units``/``out_units`` are input/output channels (or features);
    ``fan_in`` = kh*kw*in (the length of one row); ``kernel_shape`` the
    kernel's shape. ``input_layer`` names the weight layer whose output
    channels feed this one (None for the first), which FLOPs models with
    input-side sparsity (FedDrop) need.

    ``kind`` (see :data:`LAYER_KINDS`): ``"dense"`` ([in, out]), ``"conv"`` (HWIO; grouped or
    depthwise: ``[kh, kw, in/groups, out]``), and, from Flax modules, ``"dense_general"``
    (DenseGeneral/LinearGeneral, attention projections: ``[*in axes, *out axes]``), ``"einsum"``
    (Einsum), ``"embed"`` (Embed: ``[vocab, features]``, a lookup: 0 MACs), ``"recurrent"`` (a Dense
    or Conv inside a recurrent cell, run once per step: ``macs`` counts every step) and ``"scanned"`` (a
    layer repeated by a lifted scan, ``nn.scan`` over layers or NNX blocks from ``nnx.vmap`` run by
    ``nnx.scan``: one kernel per repetition stacked on leading axes, ``macs`` counting every repetition,
    no rows). A row (one output
    unit) is ``kernel[..., i]`` over the last ``out_axes`` axes flattened: ``out_units`` is their product;
    ``out_axes == 0`` means the kernel's output axes are not its trailing ones (an Einsum such as
    ``"bnd,ndh->bnh"``): it has no rows, and row mechanisms refuse it.

    ``contraction``: how many kernel entries each output sums over, read from the contracted axes of
    the traced product (``from_flax``), where the kernel's shape says otherwise (a fused qkv Einsum
    ``"BTD,SNDH->SBTNH"`` contracts D, not 3 x heads x D); None: ``fan_in`` is the shape's.
    ``uses``: how many times one forward pass multiplies by the kernel (a shared head, 2).
    """
    name: str
    kind: str  # one of LAYER_KINDS
    kernel_shape: tuple[int, ...]
    in_units: int
    out_units: int
    macs: int
    input_layer: str | None = None
    out_axes: int = 1
    contraction: int | None = None
    uses: int = 1

    @property
    def fan_in(self) -> int:
        """Entries each output sums over: the traced contraction when recorded, else from the shape."""
        if self.contraction is not None:
            return int(self.contraction)
        if self.out_axes != 1:
            return int(math.prod(self.kernel_shape)) // max(int(self.out_units), 1)
        return int(math.prod(self.kernel_shape[:-1]))

    @property
    def num_weights(self) -> int:
        return int(math.prod(self.kernel_shape))


@dataclasses.dataclass(frozen=True)
class Model:
    """A model every algorithm can train: its weight layers (``layers``, with MACs per example) and
    two pure functions, ``init(key) -> variables`` and ``apply(variables, x, ...) -> (logits,
    batch_stats)`` (see the module docstring). Built by the zoo (``make_model``) or from any Flax
    module (``from_flax``)."""
    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    layers: tuple[LayerInfo, ...]
    init_fn: Callable[[jax.Array], Variables] = dataclasses.field(repr=False)
    apply_fn: Callable[..., tuple[jax.Array, dict]] = dataclasses.field(repr=False)
    # False when a layer's input is more than its ``input_layer``'s output (residual / attention models):
    # FedDrop's eq. 10 FLOPs and Caldas' dropout refuse them (docs/design.md, "Models and hooks").
    sequential: bool = True
    # (entry, layer): ``params``/``batch_stats`` entries of no weight layer holding one value per output
    # channel of ``layer`` (a ResNet's pre-activation BatchNorm over the residual stream; docs/design.md).
    channel_entries: tuple[tuple[str, str], ...] = ()
    # True when the layers' widths are fixed by the model's own code (a Flax module from
    # ``from_flax``): a narrower sub-model cannot be cut out of it, only masked (HeteroFL/FjORD's
    # ``sliced=False``). The zoo's models take their widths from the kernels they are given.
    fixed_widths: bool = False
    # (layer, what leaks): its dropped units are not zero where the next layer reads them, found by
    # ``from_flax``'s probe; refused by ``check_unit_drops`` (docs/design.md, "Your Flax model"). Empty for the zoo.
    unit_drop_leaks: tuple[tuple[str, str], ...] = ()
    # MACs per example of products of no weight layer (attention's scores and values), from the traced program:
    # ``forward_macs`` is then the program's total. 0 for the zoo (hand-written tables).
    other_macs: int = 0
    # The slowest BatchNorm's momentum (Flax's, 1 - PyTorch's; the zoo's keeps 0.9), read by ``batch_norm_lag``
    # (docs/design.md, "BatchNorm in federated runs"). Unused by a model without ``batch_stats``.
    batch_norm_momentum: float = 0.9
    # (layer, what): its output does not follow its kernel's rows (a product beside the kernel's, found by
    # ``from_flax``); refused by ``check_layer_kinds`` (docs/design.md, "Your Flax model"). Empty for the zoo.
    row_leaks: tuple[tuple[str, str], ...] = ()

    def init(self, key: jax.Array) -> Variables:
        return self.init_fn(key)

    def apply(self, variables: Variables, x: jax.Array, *, train: bool = False,
              hooks: Hooks = NO_HOOKS, sample_mask: jax.Array | None = None,
              rng: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """x: [B, *input_shape] float -> (logits [B, num_classes], new batch_stats)."""
        return self.apply_fn(variables, x, train=train, hooks=hooks,
                             sample_mask=sample_mask, rng=rng)

    @property
    def forward_macs(self) -> int:
        return sum(layer.macs for layer in self.layers) + int(self.other_macs)

    @property
    def num_params(self) -> int:
        params = self.init(jax.random.PRNGKey(0))["params"]
        return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))

    def layer(self, name: str) -> LayerInfo:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def check_unit_drops(self, algorithm: str, layers: Sequence[str], what: str, *, any_order: bool = False) -> None:
        """Refuses, in one line, an ``algorithm`` that zeroes the output units of ``layers`` (``what`` it
        does) when a dropped unit of one of them is not zero downstream (``unit_drop_leaks``): the
        dropped products would be booked as not computed while they are. ``any_order``: the algorithm
        counts only how many of a layer's inputs are dropped, not which kernel rows read them, so a next
        layer reading the channels in another order (``UNIT_ORDER`` leaks: a transpose before a flatten)
        is no leak for it."""
        leaks = [(layer, why) for layer, why in self.unit_drop_leaks
                 if layer in set(layers) and not (any_order and why.startswith(UNIT_ORDER))]
        if leaks:
            more = f" (also at {', '.join(repr(l) for l, _ in leaks[1:])})" if len(leaks) > 1 else ""
            if leaks[0][1].startswith(UNIT_ORDER):
                raise ValueError(f"{algorithm}: model {self.name}: {leaks[0][1][len(UNIT_ORDER):]}{more}; {algorithm} "
                                 f"{what} and takes a dropped channel's rows of the next layer to be row f with f % "
                                 "channels: flatten channels last (without the transpose: the same network up to "
                                 "a permutation of the next layer's rows), or use an algorithm that drops no units "
                                 "(fedavg, spafl, fsl, fedpm)")
            raise ValueError(f"{algorithm}: model {self.name}: {leaks[0][1]}{more}; {algorithm} {what} and counts "
                             "a dropped unit's products as not computed: put flax's nn.BatchNorm / nnx.BatchNorm "
                             "directly after the layer (from_flax zeroes behind it) or a normalisation per unit, "
                             "or use an algorithm that drops no units (fedavg, spafl, fsl, fedpm)")


# A ``Model.unit_drop_leaks`` reason that is only about order: the dropped units are zero where the next layer
# reads them, but its kernel rows read them in another order than channels last (row f reads channel f % C).
UNIT_ORDER = "channel order: "


LAYER_KINDS = ("dense", "conv", "dense_general", "einsum", "embed", "recurrent", "scanned")


def check_layer_kinds(model: Model, algorithm: str, supported: Sequence[str], what: str, *,
                      rows: bool = False, other_macs: bool = True, grouped: bool = True, shared: bool = False) -> None:
    """Refuses, in one line naming the first offending layer and why, a model with a weight layer whose
    kind ``algorithm``'s mechanism does not act on. ``what`` says what the mechanism does to the kinds it
    supports (e.g. "drops output channels of dense/conv layers"). ``rows``: the mechanism acts on rows
    (``kernel[..., i]``), so a layer without rows (``out_axes == 0``) is refused too. ``other_macs=False``:
    the mechanism's FLOPs model covers weight layers only, so products outside them (attention's scores
    and values, ``Model.other_macs``) are refused. ``grouped=False``: the mechanism pairs every input channel
    with every output channel, so a grouped or depthwise convolution (``in_units`` != the kernel's input
    axis) is refused. ``shared=True``: the mechanism acts on a kernel the same way at each of its uses (a
    layer applied twice, ``LayerInfo.uses``); else such a layer is refused. Every caller thresholds rows or
    drops units, so a layer in ``Model.row_leaks`` (its output does not follow its kernel's rows) is
    refused too. The table of layer kind x mechanism is in docs/design.md."""
    leaks = dict(model.row_leaks)
    for layer in model.layers:
        if layer.name in leaks:
            raise ValueError(f"{algorithm}: layer {layer.name} of model {model.name} {leaks[layer.name]}; "
                             f"{algorithm} {what} and books a pruned or dropped unit's products as not computed: "
                             "compute the extra path in a weight layer of its own (nn.Dense, nnx.Linear)"
                             f"{f', keep the layer dense (dense_layers={layer.name})' if algorithm == 'spafl' else ''}"
                             ", or use an algorithm that masks weights (fedavg, fedpm)")
        if not shared and layer.uses > 1:
            raise ValueError(f"{algorithm}: layer {layer.name} of model {model.name} is applied {layer.uses} times "
                             f"in one forward pass (shared weights); {algorithm} {what} and follows each layer's "
                             "output to one next layer: give each use its own module, or use spafl, fedpm, fsl or "
                             "the fedavg family")
        if layer.kind not in supported:
            raise ValueError(f"{algorithm}: layer {layer.name} of model {model.name} is a {layer.kind} layer "
                             f"(kind {layer.kind!r}, kernel {tuple(layer.kernel_shape)}); {algorithm} {what}, "
                             f"so it would leave this layer's weights out: use another algorithm for this model "
                             f"(the layer kind x mechanism table is in docs/design.md)")
        if rows and layer.out_axes == 0:
            raise ValueError(f"{algorithm}: layer {layer.name} of model {model.name} is an {layer.kind} layer whose "
                             f"kernel {tuple(layer.kernel_shape)} has no output rows (its output axes are not the "
                             f"kernel's last ones); {algorithm} {what}: reorder the einsum so that the kernel's "
                             "output axes come last, or use another algorithm")
        if not grouped and layer.kind == "conv" and layer.in_units != layer.kernel_shape[-2]:
            raise ValueError(f"{algorithm}: layer {layer.name} of model {model.name} is a grouped convolution "
                             f"({layer.in_units} input channels in groups of {layer.kernel_shape[-2]}); {algorithm} "
                             f"{what} and pairs every input channel with every output channel, which a grouped "
                             "kernel does not hold: use another algorithm for this model")
    if not other_macs and model.other_macs:
        raise ValueError(f"{algorithm}: model {model.name} computes {model.other_macs} multiply-accumulates per "
                         "example outside its weight layers (e.g. attention's score and value products), which "
                         f"{algorithm}'s FLOPs model does not cover ({algorithm} {what})")


# ---------------------------------------------------------------- initialisers
def torch_default_init(key, shape, fan_in):
    """PyTorch's default for conv/linear (kaiming_uniform(a=sqrt 5)): U(+-1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def he_normal_init(key, shape, fan_in):
    return jax.random.normal(key, shape, jnp.float32) * math.sqrt(2.0 / fan_in)


def he_uniform_init(key, shape, fan_in):
    bound = math.sqrt(6.0 / fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def glorot_normal_init(key, shape, fan_in):
    fan_out = shape[-1] * int(math.prod(shape[:-2])) if len(shape) > 2 else shape[-1]
    return jax.random.normal(key, shape, jnp.float32) * math.sqrt(2.0 / (fan_in + fan_out))


INITIALIZERS = {
    "torch": torch_default_init,
    "he_normal": he_normal_init,
    "he_uniform": he_uniform_init,
    "glorot_normal": glorot_normal_init,
}


# ---------------------------------------------------------------- sequential nets
@dataclasses.dataclass(frozen=True)
class Conv:
    name: str
    features: int
    kernel_size: int
    stride: int = 1
    padding: str = "VALID"
    bias: bool = False
    batch_norm: bool = False
    relu: bool = True
    pool: int | None = None  # max-pool window after the activation


@dataclasses.dataclass(frozen=True)
class Dense:
    name: str
    features: int
    bias: bool = False
    batch_norm: bool = False
    relu: bool = True


@dataclasses.dataclass(frozen=True)
class Flatten:
    pass


@dataclasses.dataclass(frozen=True)
class GlobalAvgPool:
    pass


@dataclasses.dataclass(frozen=True)
class MaxPool:
    window: int = 2


@dataclasses.dataclass(frozen=True)
class AvgPool:
    """Average pool (floor mode); ``stride`` defaults to ``window``. PyTorch's
    AdaptiveAvgPool2d(2) is AvgPool(3, 2) on 5x5 maps and AvgPool(2, 1) on 3x3."""
    window: int = 2
    stride: int | None = None


Block = Any


def sequential(name: str, input_shape: Sequence[int], num_classes: int,
               blocks: Sequence[Block], *, init: str = "torch",
               conv_impl: str = "auto") -> Model:
    """Builds a feed-forward model from conv/dense blocks.

    A block is weight layer -> [BatchNorm] -> [ReLU] -> hooks.activation ->
    [max-pool]. The last Dense block must have ``features == num_classes``
    and ``relu=False``.
    """
    if init not in INITIALIZERS:
        raise ValueError(f"unknown init {init!r}; valid: {sorted(INITIALIZERS)}")
    init_w = INITIALIZERS[init]
    shape = tuple(input_shape)
    infos: list[LayerInfo] = []
    previous = None
    for block in blocks:
        if isinstance(block, Conv):
            h, w, c = shape
            if block.padding == "SAME":
                ho, wo = -(-h // block.stride), -(-w // block.stride)
            else:
                ho = (h - block.kernel_size) // block.stride + 1
                wo = (w - block.kernel_size) // block.stride + 1
            kshape = (block.kernel_size, block.kernel_size, c, block.features)
            macs = ho * wo * block.kernel_size * block.kernel_size * c * block.features
            infos.append(LayerInfo(block.name, "conv", kshape, c, block.features, macs, previous))
            previous = block.name
            shape = (ho, wo, block.features)
            if block.pool:
                shape = (ho // block.pool, wo // block.pool, block.features)
            _check_spatial(name, input_shape, block.name, shape)
        elif isinstance(block, Dense):
            (d,) = shape if len(shape) == 1 else (None,)
            if d is None:
                raise ValueError(f"{name}: Dense block {block.name} needs a Flatten before it")
            infos.append(LayerInfo(block.name, "dense", (d, block.features), d, block.features,
                                   d * block.features, previous))
            previous = block.name
            shape = (block.features,)
        elif isinstance(block, Flatten):
            shape = (int(math.prod(shape)),)
        elif isinstance(block, GlobalAvgPool):
            shape = (shape[-1],)
        elif isinstance(block, MaxPool):
            shape = (shape[0] // block.window, shape[1] // block.window, shape[2])
            _check_spatial(name, input_shape, "max-pool", shape)
        elif isinstance(block, AvgPool):
            stride = block.stride or block.window
            shape = ((shape[0] - block.window) // stride + 1, (shape[1] - block.window) // stride + 1,
                     shape[2])
        else:
            raise TypeError(f"unknown block {block!r}")
    if shape != (num_classes,):
        raise ValueError(f"{name}: output shape {shape} != ({num_classes},)")

    def init_fn(key):
        params, stats = {}, {}
        keys = jax.random.split(key, len(infos))
        for k, info in zip(keys, infos):
            block = next(b for b in blocks if getattr(b, "name", None) == info.name)
            kk, kb = jax.random.split(k)
            p = {"kernel": init_w(kk, info.kernel_shape, info.fan_in)}
            if block.bias:
                p["bias"] = torch_default_init(kb, (info.out_units,), info.fan_in)
            if block.batch_norm:
                bn, stats[info.name] = L.batch_norm_variables(info.out_units)
                p.update(bn)
            params[info.name] = p
        return {"params": params, "batch_stats": stats}

    def apply_fn(variables, x, *, train, hooks, sample_mask, rng):
        del rng
        params, stats = variables["params"], variables.get("batch_stats", {})
        new_stats = dict(stats)
        for block in blocks:
            if isinstance(block, (Conv, Dense)):
                p = params[block.name]
                kernel = hooks.kernel(block.name, p["kernel"])
                if isinstance(block, Conv):
                    x = L.conv2d(x, kernel, stride=block.stride, padding=block.padding, impl=conv_impl,
                                 name=block.name)
                else:
                    x = L.dense(x, kernel)
                if block.bias:
                    x = x + p["bias"]
                if block.batch_norm:
                    x, new_stats[block.name] = L.batch_norm(
                        x, p["bn_scale"], p["bn_bias"], stats[block.name],
                        train=train, sample_mask=sample_mask)
                if block.relu:
                    x = jax.nn.relu(x)
                x = hooks.activation(block.name, x)
                if isinstance(block, Conv) and block.pool:
                    x = L.max_pool(x, block.pool)
            elif isinstance(block, Flatten):
                # NHWC flatten; PyTorch flattens NCHW. Equivalent up to a fixed
                # permutation of the next layer's rows, which is immaterial here.
                x = x.reshape(x.shape[0], -1)
            elif isinstance(block, GlobalAvgPool):
                x = x.mean(axis=(1, 2))
            elif isinstance(block, MaxPool):
                x = L.max_pool(x, block.window)
            elif isinstance(block, AvgPool):
                x = L.avg_pool(x, block.window, block.stride)
        return x, new_stats

    return Model(name, shape_tuple(input_shape), num_classes, tuple(infos), init_fn, apply_fn)


def _check_spatial(model_name, input_shape, where, shape):
    if shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{model_name} does not fit {tuple(input_shape)} inputs: the feature map is empty "
                         f"after {where}; use larger images or another {arg('model')}")


def shape_tuple(shape) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)
