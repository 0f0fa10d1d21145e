"""Any Flax model as a :class:`fedjax_sparse.models.Model`: ``from_flax(module, input_shape=...)``.

From one abstract forward pass of a ``flax.linen`` or ``flax.nnx`` module with its layer calls intercepted
(``_Calls``) and from the module's own program (:mod:`~fedjax_sparse.models.flax.program_flow`), this module
derives the weight layers (every parameterised product in call order, named by its module path: ``"conv1"``,
``"Block_0/Dense_0"``), their MACs and data flow, and the ``BatchNorm`` reading each (``Model.channel_entries``).
At run time ``hooks.kernel`` is applied to each kernel and ``hooks.activation`` to each layer's output (behind
its BatchNorm when it has one); plain float32 2-D ``Conv`` layers and non-overlapping ``max_pool`` run as
:mod:`fedjax_sparse.models.layers`' (``_fast_conv``, ``_zoo_max_pool``), everything else as Flax's own code.
What it cannot follow is refused in one line; the probes run last are in
:mod:`~fedjax_sparse.models.flax.probes`. The full description: docs/design.md ("Your Flax model").
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import re
import traceback
import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from fedjax_sparse.models import layers as L
from fedjax_sparse.models.flax.program_flow import layer_scope, program_flow
from fedjax_sparse.models.base import NO_HOOKS, Hooks, LayerInfo, Model, shape_tuple

Path = tuple  # a module path inside the user's variables, e.g. ("Block_0", "Dense_0") or ("layers", 0)


# ---------------------------------------------------------------- variables <-> flat entries
def _flatten(tree: dict, prefix: Path = ()) -> dict[Path, dict]:
    """Nested variables -> {module path: {leaf name: array}} (one entry per module owning leaves)."""
    entries: dict[Path, dict] = {}
    own = {k: v for k, v in tree.items() if not isinstance(v, dict)}
    if own:
        entries[prefix] = own
    for key, child in tree.items():
        if isinstance(child, dict):
            entries.update(_flatten(child, prefix + (key,)))
    return entries


def _unflatten(entries: dict[Path, dict]) -> dict:
    from flax import traverse_util
    return traverse_util.unflatten_dict({path + (leaf,): a for path, leaves in entries.items()
                                         for leaf, a in leaves.items()})


def entry_name(path: Path) -> str:
    """A module path as the entry name used in ``variables["params"]``: ``"a/b/0"`` (``"~"`` for the root)."""
    return "/".join(str(p) for p in path) if path else "~"


# ---------------------------------------------------------------- data flow
def link_layers(names: Sequence[str], in_units: Sequence[int], out_units: Sequence[int],
                sources: Sequence[frozenset], logits_sources: frozenset) -> tuple[list[str | None], bool]:
    """(input_layer of each layer, sequential) from each layer's direct sources (``program_flow``).

    A layer's ``input_layer`` is the latest layer among its sources whose output width its input is
    made of (``in_units`` a multiple of it: a flatten repeats channels); ``sequential`` holds when
    every layer reads exactly the previous one (the first: the input), as its ``input_layer`` (not a part
    of its channels: an ``nn.vmap`` over a split channel axis), and the logits the last."""
    inputs: list[str | None] = []
    for i, src in enumerate(sources):
        candidates = [j for j in sorted(src, reverse=True) if j >= 0 and in_units[i] % out_units[j] == 0]
        inputs.append(names[candidates[0]] if candidates else None)
    expected = [frozenset({i - 1}) for i in range(len(names))]
    sequential = (list(sources) == expected and logits_sources == frozenset({len(names) - 1})
                  and all(inp is not None for inp in inputs[1:]))
    return inputs, sequential


# ---------------------------------------------------------------- the shared interception logic
@dataclasses.dataclass
class _Recorded:
    path: Path
    kind: str
    kernel_shape: tuple
    in_shape: tuple
    out_axes: int = 1       # trailing kernel axes that are output units (0: none, see LayerInfo)


class _Calls:
    """What one traced forward pass does at each intercepted module call, by ``mode``: "record" runs the
    modules and records the weight layers and which BatchNorm reads which; "run" applies the activation
    hooks (and the fast convolution); "reference" runs the module's own code everywhere, with the adapter's
    BatchNorm/Dropout modes and each weight layer's call in a scope tagged with its name (``layer_scope``,
    read by ``program_flow``). ``layer_outputs``: each weight layer's output before its hook ("run" and
    "reference", not inside a lifted transform), to name the first layer where the two differ. A layer
    called more than once (a scan body traced twice, a shared head) is hooked at each call."""

    def __init__(self, mode: str, *, train: bool = False, hooks: Hooks | None = None, sample_mask=None,
                 bn_of: dict | None = None, conv_impl: str = "auto", rng=None):
        self.mode, self.train, self.hooks, self.sample_mask, self.rng = mode, train, hooks, sample_mask, rng
        self.conv_impl = conv_impl
        self.outer_trace = None               # the trace the forward pass starts on (set by apply)
        self.bn_of = bn_of or {}          # BatchNorm path -> the layer path it follows
        self.deferred = set(self.bn_of.values())
        self.recorded: list[_Recorded] = []
        self._outputs: dict[int, tuple[Path, Any]] = {}
        self.bn_after: dict[Path, Path] = {}
        self.bn_momentum: dict[Path, float] = {}   # record mode: each BatchNorm's momentum (Model.batch_norm_momentum)
        self.layer_outputs: dict[Path, Any] = {}
        # Layers whose call is in progress: a subclass's ``__call__`` that calls ``super().__call__``
        # reaches the interception again for the same layer, which is the same use, not a second one.
        self.active: list = []
        # Weight layers called inside another weight layer's call (record mode): outer path -> the first of them.
        self.inner: dict[Path, Path] = {}

    def weight_layer(self, path: Path, kind: str, kernel, x, original: Callable, conv: dict | None, *,
                     out_axes: int = 1, nested: bool = False):
        """``conv``: the layer's configuration when it is Flax's own ``Conv`` code (the fast path may
        replace it), None for a Dense or a subclass that runs its own code. ``out_axes``: the
        kernel's trailing axes that are output units; ``nested``: called inside a lifted transform (remat,
        scan, jit), its values on an inner trace (not in ``layer_outputs``)."""
        if path in self.active:
            return original()
        if self.mode == "record" and self.active:
            self.inner.setdefault(self.active[-1], path)
        out = _fast_conv(x, kernel, conv, self.conv_impl) if conv is not None and self.mode != "reference" else None
        if out is None:
            self.active.append(path)
            try:
                with layer_scope(entry_name(path)) if self.mode == "reference" else contextlib.nullcontext():
                    out = original()
            finally:
                self.active.pop()
        if self.mode in ("run", "reference") and not nested:
            self.layer_outputs[path] = out
        if self.mode == "reference":
            return out
        if self.mode == "record":
            if all(r.path != path for r in self.recorded):   # a layer called again: recorded at its first call
                self.recorded.append(_Recorded(path, kind, tuple(kernel.shape), tuple(x.shape), out_axes))
            self._outputs[id(out)] = (path, out)
            return out
        if path not in self.deferred:
            out = self.hooks.activation(entry_name(path), out)  # type: ignore[union-attr]
        return out

    def batch_norm(self, path: Path, x, original: Callable, momentum: float | None = None):
        """``original(use_running_average, mask)`` runs the module; ``momentum``: its Flax momentum."""
        if self.mode == "record" and momentum is not None:
            self.bn_momentum[path] = float(momentum)
        mask = None
        if self.train and self.sample_mask is not None:
            mask = jnp.broadcast_to(self.sample_mask.reshape((-1,) + (1,) * (x.ndim - 1)) > 0, x.shape)
        out = original(not self.train, mask)
        if self.mode == "record":
            source = self._outputs.get(id(x))
            if source is not None and source[1] is x:
                self.bn_after[path] = source[0]
        elif self.mode == "run" and path in self.bn_of:
            out = self.hooks.activation(entry_name(self.bn_of[path]), out)  # type: ignore[union-attr]
        return out


def _fast_conv(x, kernel, conv: dict, impl: str):
    """The layer through ``layers.conv2d`` when its form allows (else None: Flax's own code)."""
    k = conv["kernel_size"]
    strides = conv["strides"]
    strides = (strides,) * 2 if isinstance(strides, int) else tuple(strides or (1, 1))
    plain = (len(k) == 2 and x.ndim == 4 and len(set(strides)) == 1 and conv["padding"] in ("SAME", "VALID")
             and conv["groups"] == 1 and conv["mask"] is None
             and all(d in (None, 1) or tuple(d) == (1, 1) for d in (conv["input_dilation"], conv["kernel_dilation"]))
             and x.dtype == jnp.float32 and kernel.dtype == jnp.float32)
    if not plain:
        return None
    out = L.conv2d(x, kernel, stride=strides[0], padding=conv["padding"], impl=impl)
    if conv["bias"] is not None:
        out = out + conv["bias"]
    return out


def _conv_config(module, kernel, bias) -> dict | None:
    """What ``_fast_conv`` needs of a Flax ``Conv`` layer, or None when the layer computes something
    ``layers.conv2d`` does not: its own convolution function, a compute dtype other than float32, or a
    precision setting (its code runs then)."""
    own_conv = getattr(module, "conv_general_dilated", None) in (None, jax.lax.conv_general_dilated)
    if (not own_conv or getattr(module, "conv_general_dilated_cls", None) is not None
            or module.dtype not in (None, jnp.float32) or module.precision is not None
            or getattr(module, "preferred_element_type", None) is not None):
        return None
    return {"kernel_size": tuple(module.kernel_size) if not isinstance(module.kernel_size, int)
            else (module.kernel_size,), "strides": module.strides, "padding": module.padding,
            "groups": module.feature_group_count, "mask": getattr(module, "mask", None),
            "input_dilation": module.input_dilation, "kernel_dilation": module.kernel_dilation,
            "bias": bias if module.use_bias else None}


@contextlib.contextmanager
def _zoo_max_pool(active: bool = True):
    """While tracing, ``nn.max_pool`` / ``nnx.max_pool`` with non-overlapping windows run as the zoo's
    :func:`layers.max_pool` (reshape + max): the same forward values, the zoo's gradient (split
    evenly between tied maxima, where ``reduce_window``'s goes to one of them) and no
    ``select_and_scatter``, which is slow on XLA:CPU. Other pools run Flax's code, and all of them
    when not ``active`` (the reference of ``from_flax``'s equivalence check)."""
    if not active:
        yield
        return
    import flax.linen as nn
    import flax.linen.pooling as pooling
    from flax import nnx
    original = pooling.max_pool

    def max_pool(inputs, window_shape, strides=None, padding="VALID"):
        window = tuple(window_shape)
        if (inputs.ndim == 4 and len(window) == 2 and window[0] == window[1] and padding == "VALID"
                and (strides is None or tuple(strides) == window)):
            return L.max_pool(inputs, window[0])
        return original(inputs, window_shape, strides=strides, padding=padding)
    owners = [m for m in (nn, pooling, nnx) if getattr(m, "max_pool", None) is original]
    try:
        for owner in owners:
            owner.max_pool = max_pool  # type: ignore[attr-defined]
        yield
    finally:
        for owner in owners:
            owner.max_pool = original  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the train argument
def _mode_kwargs(call: Callable, train_argument: str | None) -> Callable[[bool], dict]:
    """How ``train`` reaches the module's ``__call__``: by the named argument, or the first of
    ``train``/``training``/``is_training`` (or ``deterministic``, negated) it takes."""
    params = inspect.signature(call).parameters
    if train_argument == "auto":
        train_argument = next((n for n in ("train", "training", "is_training", "deterministic") if n in params), None)
    if train_argument is None:
        return lambda train: {}
    if train_argument not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"from_flax: the module's __call__ has no argument {train_argument!r}; "
                         f"its arguments: {', '.join(params)}")
    if train_argument == "deterministic":
        return lambda train: {"deterministic": not train}
    return lambda train: {train_argument: train}


# ---------------------------------------------------------------- layer kinds
def einsum_out_axes(spec: str) -> int:
    """How many trailing axes of an Einsum's kernel (its second operand) are output units: those that
    appear in the output and not in the input. 0 when they are not the kernel's last axes, when the
    kernel shares an axis with both input and output (a per-head kernel ``"bnd,ndh->bnh"``) or the
    spec has an ellipsis: such a kernel has no rows."""
    spec = spec.replace(" ", "")
    if "->" not in spec or "." in spec or spec.count(",") != 1:
        return 0
    operands, out = spec.split("->")
    lhs, rhs = operands.split(",")
    outs = [c for c in rhs if c in out]
    if not outs or any(c in lhs for c in outs):
        return 0
    return len(outs) if set(rhs[-len(outs):]) == set(outs) else 0


def _linen_weight(m, args: tuple = (), kwargs: dict | None = None) -> tuple[str, str, int] | None:
    """(kind, the weight's leaf name, out_axes) of a linen weight layer called with ``args``/``kwargs``,
    None for other modules."""
    import flax.linen as nn
    if isinstance(m, nn.Embed):
        kind, leaf, out_axes = "embed", "embedding", 1
    elif isinstance(m, (nn.Dense, nn.Conv)):
        kind, leaf, out_axes = ("dense" if isinstance(m, nn.Dense) else "conv"), "kernel", 1
    elif isinstance(m, nn.DenseGeneral):
        features = m.features if isinstance(m.features, (tuple, list)) else (m.features,)
        kind, leaf, out_axes = "dense_general", "kernel", 0 if m.batch_dims else len(features)
    elif isinstance(m, nn.Einsum):
        spec = (kwargs or {}).get("einsum_str") or (args[1] if len(args) > 1 else None) or m.einsum_str
        kind, leaf, out_axes = "einsum", "kernel", einsum_out_axes(spec or "")
    else:
        return None
    parent = m.parent
    while isinstance(parent, nn.Module):
        if isinstance(parent, nn.RNNCellBase):
            return "recurrent", leaf, out_axes
        parent = parent.parent
    return kind, leaf, out_axes


@contextlib.contextmanager
def _field_cleared(module, field: str):
    """``module.field`` set to None for the duration (a frozen linen module: ``object.__setattr__``)."""
    saved = getattr(module, field)
    object.__setattr__(module, field, None)
    try:
        yield
    finally:
        object.__setattr__(module, field, saved)


# Names a dataclass writes into every (linen or nnx) subclass, which override nothing the layer computes.
_GENERATED = {"__init__", "__eq__", "__hash__", "__repr__", "__match_args__", "__annotations__", "__doc__",
              "__module__", "__qualname__", "__dataclass_fields__", "__dataclass_params__", "__abstractmethods__",
              "__parameters__", "__orig_bases__", "__slots__", "__weakref__", "__dict__"}


def _runs_flax_code(cls, base) -> bool:
    """True when ``cls`` computes what Flax's ``base`` computes: no class between them overrides a method or
    property ``base`` has (``__call__``, ``param``, ``setup``, a helper); new fields and methods of its own
    are fine. Otherwise the layer runs its own code (no fast path)."""
    inherited = {name for klass in base.__mro__ for name in vars(klass)}
    for klass in cls.__mro__:
        if klass is base:
            return True
        for name, value in vars(klass).items():
            if name in _GENERATED or name not in inherited:
                continue
            if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                return False
    return True


def _current_trace():
    from flax.core import tracers
    return tracers.current_trace()


# ---------------------------------------------------------------- linen
_PASSES = iter(range(1 << 62))   # a fresh number per traced pass (see _retraced_jit)


@contextlib.contextmanager
def _retraced_jit():
    """While active, ``nn.jit`` traces every module instance anew in this pass: it keys its ``jax.jit`` cache
    by the module's configuration, so a second identical block (or a later pass of the adapter) would reuse
    the first trace, and its layers would be neither intercepted nor tagged (their products booked to the
    first block). The key gains the module's path and the pass's number; the engine jits the whole program
    anyway."""
    try:
        from flax.linen import transforms
        proxy = transforms._HashableProxy
        original = proxy.__dict__["from_module"]
    except (ImportError, AttributeError, KeyError):   # another Flax: its nn.jit is traced as it comes
        yield
        return
    nonce = next(_PASSES)

    def from_module(cls, module):
        made = original.__func__(cls, module)
        path = tuple(module.scope.path) if module.scope is not None else ()
        return cls(made.module_ref, hash((made.hash_key, nonce, path)))
    proxy.from_module = classmethod(from_module)
    try:
        yield
    finally:
        proxy.from_module = original


@contextlib.contextmanager
def _linen_interceptor(calls: _Calls, prefix: Callable[[], Path | None] = lambda: ()):
    """The linen method interceptor of one traced pass. ``prefix()``: the path of the variables' root (a
    bridge module's path inside an NNX model), None when a linen module runs outside the adapter's view."""
    import flax.linen as nn

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        root = prefix()
        if context.method_name != "__call__" or root is None:
            return next_fun(*args, **kwargs)
        path = tuple(root) + (tuple(m.scope.path) if m.scope is not None else ())
        weight = _linen_weight(m, args, kwargs)
        params = m.variables.get("params", {}) if weight is not None else {}
        if weight is not None and weight[1] in params:
            kind, leaf, out_axes = weight
            # Inside a lifted transform (``nn.scan`` of ``nn.RNN``, ``nn.remat``...): another trace.
            nested = _current_trace() != calls.outer_trace
            # The fast path only where the layer runs Flax's own Conv code: a subclass that overrides
            # anything of it (__call__, or ``param`` standardising the kernel as BiT's StdConv does)
            # means something else by its kernel, and runs its own code.
            conv = _conv_config(m, params[leaf], params.get("bias")) \
                if isinstance(m, nn.Conv) and _runs_flax_code(type(m), nn.Conv) and not nested else None
            return calls.weight_layer(path, kind, params[leaf], args[0], lambda: next_fun(*args, **kwargs),
                                      conv, out_axes=out_axes, nested=nested)
        if isinstance(m, nn.BatchNorm):
            x = args[0]

            def original(use_running_average, mask):
                # The adapter's mode whatever the module set (``BatchNorm(not self.training)`` fixes it
                # when the module is built; Flax refuses a mode given twice, so the field is cleared
                # for this call).
                with _field_cleared(m, "use_running_average"):
                    return next_fun(x, use_running_average=use_running_average, mask=mask)
            return calls.batch_norm(path, x, original, m.momentum)
        if isinstance(m, nn.Dropout):
            # Active in training when a key reached Model.apply (the engine's local steps pass one),
            # the identity otherwise, whatever ``deterministic`` the module was built with; a subclass
            # overriding Flax's Dropout runs its own code in both modes.
            active = calls.mode in ("run", "reference") and calls.train and calls.rng is not None
            if not active and _runs_flax_code(type(m), nn.Dropout):
                return args[0]
            with _field_cleared(m, "deterministic"):
                return next_fun(*args, **{**kwargs, "deterministic": not active})
        return next_fun(*args, **kwargs)
    with nn.intercept_methods(interceptor), _retraced_jit():
        yield


def _linen_parts(module, train_kwargs):
    def init(key, x):
        return module.init({"params": key}, x, **train_kwargs(False))

    def apply(nested: dict, x, calls: _Calls, train: bool):
        mutable = ["batch_stats"] if train and nested.get("batch_stats") else False
        rngs = {"dropout": calls.rng} if calls.rng is not None else None
        calls.outer_trace = _current_trace()
        with _linen_interceptor(calls), _zoo_max_pool(calls.mode != "reference"):
            out = module.apply(nested, x, **train_kwargs(train), rngs=rngs, mutable=mutable)
        if mutable:
            logits, updated = out
            return logits, updated["batch_stats"]
        return out, nested.get("batch_stats", {})
    return init, apply


# ---------------------------------------------------------------- nnx
_NNX_PATH = "_fjs_path"   # a static attribute naming each module's path: it survives NNX's lifted transforms


def _nnx_path(module) -> Path:
    """The module's path in the model: read from the static attribute ``apply`` sets on every module of
    the merged model, which NNX's transforms (``nnx.remat``, ``nnx.scan``, ``nnx.vmap``) carry into the copies
    they run."""
    path = getattr(module, _NNX_PATH, None)
    if path is None:
        raise ValueError(f"from_flax: a {type(module).__name__} runs that is not part of the model the adapter "
                         "merged (a module created inside __call__, or a copy made by a transform that drops static "
                         "attributes), so its weights cannot be followed: create every layer in __init__")
    return path


def _nnx_parts(module, train_kwargs):
    from flax import nnx

    graphdef, params_state, stats_state, rest_state = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
    weight_classes = {nnx.Linear: ("dense", "kernel"), nnx.Conv: ("conv", "kernel"),
                      nnx.LinearGeneral: ("dense_general", "kernel"), nnx.Einsum: ("einsum", "kernel"),
                      nnx.Embed: ("embed", "embedding")}
    bridge = getattr(getattr(nnx, "bridge", None), "ToNNX", None)
    originals = {cls: cls.__call__ for cls in (*weight_classes, nnx.BatchNorm, nnx.Dropout)
                 + ((bridge,) if bridge is not None else ())}
    # Subclasses of the weight layers that define their own __call__ (a weight-standardised conv): they are
    # the weight layers, running their own code (no fast path); their super().__call__ runs Flax's.
    overriding = {c: c.__dict__["__call__"] for _, m in nnx.iter_graph(module)
                  if isinstance(m, tuple(weight_classes)) for c in type(m).__mro__
                  if c not in weight_classes and "__call__" in c.__dict__ and issubclass(c, tuple(weight_classes))}

    @contextlib.contextmanager
    def intercepted(calls: _Calls, merged):
        cells = {tuple(p) for p, m in nnx.iter_graph(merged) if isinstance(m, nnx.RNNCellBase)}
        bridges: list = []    # the paths of the nnx.bridge.ToNNX modules whose linen module is running

        def weight_call(cls):
            # Flax's own weight class, or a subclass in ``overriding``: that one runs its own code (no fast
            # path), and is a weight layer only while it holds its kernel as an nnx.Param.
            kind, leaf = weight_classes[next(c for c in cls.__mro__ if c in weight_classes)]
            run = overriding.get(cls) or originals[cls]

            def call(self, x, *a, **k):
                kernel = getattr(self, leaf, None)
                if cls in overriding and not isinstance(kernel, nnx.Param):
                    return run(self, x, *a, **k)
                kernel, out_axes, conv = kernel[...], 1, None
                path = _nnx_path(self)
                # Inside a lifted transform (nnx.remat, nnx.scan, nnx.vmap): another trace, a copy of the module.
                nested = _current_trace() != calls.outer_trace
                if cls is nnx.LinearGeneral:
                    features = self.out_features if isinstance(self.out_features, (tuple, list)) \
                        else (self.out_features,)
                    out_axes = 0 if getattr(self, "batch_axis", None) else len(features)
                elif cls is nnx.Einsum:
                    out_axes = einsum_out_axes(k.get("einsum_str") or (a[0] if a else None) or self.einsum_str or "")
                elif cls is nnx.Conv and not nested and not a and not k and _runs_flax_code(type(self), nnx.Conv):
                    conv = _conv_config(self, kernel, self.bias[...] if self.use_bias else None)
                in_cell = any(path[:i] in cells for i in range(len(path)))
                return calls.weight_layer(path, "recurrent" if in_cell else kind, kernel, x,
                                          lambda: run(self, x, *a, **k), conv, out_axes=out_axes, nested=nested)
            return call

        def batch_norm(self, x, *a, **k):
            return calls.batch_norm(_nnx_path(self), x, lambda ura, mask: originals[nnx.BatchNorm](
                self, x, use_running_average=ura, mask=mask), self.momentum)

        def dropout(self, x, *a, **k):
            # Each layer its own key: the step's key folded with the layer's path.
            if calls.mode in ("run", "reference") and calls.train and calls.rng is not None:
                key = jax.random.fold_in(calls.rng, zlib.crc32(entry_name(_nnx_path(self)).encode()))
                return originals[nnx.Dropout](self, x, deterministic=False, rngs=key)
            return x

        def to_nnx(self, *a, **k):
            # A linen module inside nnx.bridge.ToNNX: its variables live under the bridge's path.
            # The path attribute is taken off for the call: ToNNX reads its other attributes as linen variables.
            path = _nnx_path(self)
            bridges.append(path)
            object.__delattr__(self, _NNX_PATH)
            try:
                return originals[bridge](self, *a, **k)
            finally:
                object.__setattr__(self, _NNX_PATH, path)
                bridges.pop()
        patched = {**{cls: weight_call(cls) for cls in (*weight_classes, *overriding)},
                   nnx.BatchNorm: batch_norm, nnx.Dropout: dropout, **({bridge: to_nnx} if bridge is not None else {})}
        try:
            for cls, fn in patched.items():
                cls.__call__ = fn  # type: ignore[method-assign]
            with _linen_interceptor(calls, lambda: bridges[-1] if bridges else None):
                yield
        finally:
            for cls, fn in {**originals, **overriding}.items():
                cls.__call__ = fn  # type: ignore[method-assign]

    def merge(nested: dict):
        # Fresh copies of the state templates, filled with this call's (traced) arrays. The rest (an nnx.Rngs'
        # counters, what sow stored when the user called the module) is copied too: NNX refuses to update,
        # inside a trace, a variable created outside it.
        params = jax.tree_util.tree_map(lambda v: v, params_state)
        nnx.replace_by_pure_dict(params, nested["params"])
        stats = jax.tree_util.tree_map(lambda v: v, stats_state)
        if nested.get("batch_stats"):
            nnx.replace_by_pure_dict(stats, nested["batch_stats"])
        merged = nnx.merge(graphdef, params, stats, jax.tree_util.tree_map(lambda v: v, rest_state))
        for path, sub in nnx.iter_graph(merged):
            if isinstance(sub, nnx.Module):
                object.__setattr__(sub, _NNX_PATH, tuple(path))
        return merged

    def init(key, x):
        # An NNX module holds its initial weights: ``key`` is not used (build the module with the
        # seed you want, or pin weights with --init-params). Copies, never the module's own buffers:
        # the engine donates the state it is given, which would delete the user's module's arrays.
        del key, x
        fresh = {"params": nnx.to_pure_dict(params_state), "batch_stats": nnx.to_pure_dict(stats_state)}
        return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), fresh)

    def apply(nested: dict, x, calls: _Calls, train: bool):
        merged = merge(nested)
        calls.outer_trace = _current_trace()
        with intercepted(calls, merged), _zoo_max_pool(calls.mode != "reference"):
            logits = merged(x, **train_kwargs(train))
        stats = nnx.to_pure_dict(nnx.state(merged, nnx.BatchStat)) if nested.get("batch_stats") else {}
        return logits, stats
    return init, apply


# ---------------------------------------------------------------- errors in the user's words
def _user_frame(error: BaseException) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost traceback frame in the user's code: outside jax, flax,
    numpy, the standard library and fedjax_sparse (whose example models count as the user's)."""
    import sysconfig

    import flax
    import jaxlib
    import numpy
    dirs = [os.path.dirname(m.__file__ or "") for m in (jax, jaxlib, flax, numpy)]
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    libraries = tuple(os.path.join(d, "") for d in dirs + [package, sysconfig.get_paths()["stdlib"]])
    found = None
    for frame, line in traceback.walk_tb(error.__traceback__):
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(libraries) or path.endswith(os.path.join("models", "flax_examples.py")):
            found = (path, line, frame.f_code.co_name)
    return found


_SHAPE_WORDS = ("shape", "dimension", "rank", "axis", "axes", "broadcast", "incompatible", "size")


def _failing_module(error: BaseException, classes: tuple):
    """The innermost module of one of ``classes`` whose method is on the traceback (None if none)."""
    modules = [frame.f_locals.get("self") for frame, _ in traceback.walk_tb(error.__traceback__)]
    return next((m for m in reversed(modules) if isinstance(m, classes)), None)


def _module_name(module) -> str:
    if module is None:
        return "a layer"
    scope = getattr(module, "scope", None)
    path = tuple(scope.path) if scope is not None else ()
    return f"layer {entry_name(path)!r} ({type(module).__name__})" if path else f"{type(module).__name__}.__call__"


def _engine_error(model_name: str, error: Exception, train: bool) -> Exception | None:
    """What the engine cannot give the module, in one line with the fix (None for other errors): an rng
    stream other than ``dropout`` (or a dropout key in evaluation), or a collective over an axis name
    (a cross-device BatchNorm: the engine's vmap over clients binds none)."""
    import flax.linen as nn
    from flax import nnx
    first = str(error).splitlines()[0] if str(error).strip() else ""
    where = _user_frame(error)
    at = f" at {where[0]}:{where[1]}" if where else ""
    stream = re.search(r'needs PRNG for "([^"]*)"', first)
    if stream:
        module = _failing_module(error, (nn.Module,))
        who = _module_name(module)
        if stream.group(1) == "dropout" and not train:
            return ValueError(f"from_flax: {model_name}: {who} asks for a 'dropout' key in evaluation mode{at}; "
                              "evaluation passes none (dropout off): draw it only in training (gate "
                              "self.make_rng('dropout') on the module's train/deterministic argument)")
        return ValueError(f"from_flax: {model_name}: {who} asks for the rng stream {stream.group(1)!r}{at}, but "
                          "the engine gives a model only a 'dropout' key (fresh per local training step, none in "
                          "evaluation): draw from self.make_rng('dropout') instead")
    axis = re.search(r"unbound axis name: ?([^\s.,]+)", first)
    if isinstance(error, NameError) and axis:
        module = _failing_module(error, (nn.BatchNorm, nnx.BatchNorm))
        who = _module_name(module)
        return ValueError(f"from_flax: {model_name}: {who} computes over the device axis {axis.group(1)!r}{at} "
                          "(BatchNorm axis_name: cross-device statistics), which the engine's vmap over clients "
                          "does not bind: drop axis_name (each client's statistics are its own)")
    return None


def _runs_alone(module, input_shape: tuple, kwargs: dict) -> bool:
    """Whether the module runs by itself, outside the adapter, on a batch of zeros [2, *input_shape]
    (abstractly: no FLOPs spent; an NNX module on a copy, so the user's module is untouched)."""
    x = jnp.zeros((2,) + tuple(input_shape), jnp.float32)
    try:
        if _is_nnx(module):
            from flax import nnx
            nnx.eval_shape(lambda m, x: m(x, **kwargs), nnx.clone(module), x)
        else:
            key = jax.random.PRNGKey(0)
            jax.eval_shape(lambda: module.init_with_output({"params": key, "dropout": key}, x, **kwargs))
    except Exception:
        return False
    return True


# What an adapter failure on a module that runs by itself most likely means, by the words of the exception.
_ADAPTER_CAUSES = (
    ("trace level", "it updates NNX state (an nnx.Rngs' counter, a value stored by sow) from inside a transform "
                    "the adapter cannot follow"),
    ("different trace", "it updates NNX state from inside a transform the adapter cannot follow"),
)


def _build_error(model_name: str, input_shape: tuple, error: Exception, train: bool = False,
                 alone: bool = False) -> Exception:
    """The one-line error for a module that fails on a batch ``[1, *input_shape]``: the exception, its
    first line and the user's file and line; the input_shape hint only for shape errors. Rng streams
    and axis names the engine does not provide are said as such (``_engine_error``). ``alone``: the module
    runs by itself (``_runs_alone``), so the failure is the adapter's, and the message says so."""
    engine = _engine_error(model_name, error, train)
    if engine is not None:
        return engine
    first = str(error).splitlines()[0] if str(error).strip() else "no message"
    where = _user_frame(error)
    at = f" at {where[0]}:{where[1]} (in {where[2]})" if where else ""
    if alone:
        cause = next((why for words, why in _ADAPTER_CAUSES if words in first.lower()),
                     "a construct of the module the adapter cannot follow")
        return ValueError(f"from_flax: {model_name} runs by itself on inputs of shape [batch, "
                          f"{', '.join(map(str, input_shape))}] but not under from_flax, which intercepts its layers "
                          f"({type(error).__name__}: {first}{at}): {cause}; this is a limit of the adapter, not an "
                          "error in the model: please report it with the model, and meanwhile train the model's "
                          "layers outside that construct")
    what = f"from_flax: {model_name} raised {type(error).__name__}: {first}{at}, on inputs of shape [batch, " \
           f"{', '.join(map(str, input_shape))}]"
    import flax.linen as nn
    from flax import nnx
    conv = _failing_module(error, (nn.Conv, nnx.Conv))
    if conv is not None:
        spatial = len(conv.kernel_size) if not isinstance(conv.kernel_size, int) else 1
        if len(input_shape) != spatial + 1:
            return ValueError(f"{what}; its {spatial}-D Conv takes inputs of rank {spatial + 2} [batch, "
                              f"{', '.join(['size'] * spatial)}, channels] but input_shape={input_shape} gives rank "
                              f"{len(input_shape) + 1}: give input_shape as {spatial} sizes and the channels, "
                              "e.g. (28, 28, 1)")
    if isinstance(error, (ZeroDivisionError, IndexError)) or any(w in first.lower() for w in _SHAPE_WORDS):
        return ValueError(f"{what}; check input_shape (one example's shape, no batch axis) against what the "
                          "model expects, e.g. (28, 28, 1) for 28x28 grayscale images")
    return ValueError(f"{what}; the error is in the model's own code: call the module on a batch of that shape "
                      "outside fedjax_sparse to debug it")


def _not_a_module(module) -> TypeError:
    import flax.linen as nn
    from flax import nnx
    if isinstance(module, type) and issubclass(module, (nn.Module, nnx.Module)):
        return TypeError(f"from_flax takes a Flax module instance, not the class {module.__name__}: "
                         f"pass {module.__name__}(...)")
    what = f"{type(module).__name__} {getattr(module, '__name__', '')}".strip()
    if callable(module):
        return TypeError(f"from_flax takes a flax.linen or flax.nnx Module, not a {what}: wrap the function in a "
                         "flax.linen.Module whose __call__ creates its layers (nn.Dense, nn.Conv) and calls it; "
                         "for the project's own models use fedjax_sparse.models.make_model(name, ...)")
    return TypeError(f"from_flax takes a flax.linen or flax.nnx Module, not {type(module).__name__}; for the "
                     "project's own models use fedjax_sparse.models.make_model(name, ...)")


def _check_call_arguments(module, call: Callable, train_argument: str | None) -> None:
    """Refuses a ``__call__`` that needs more than the input and the train flag (``from_flax`` passes
    only those): which argument, and the fix."""
    params = list(inspect.signature(call).parameters.values())[1:]  # after self
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise TypeError(f"from_flax: {type(module).__name__}.__call__ takes no input argument; it must take the "
                        "batch x [batch, *input_shape] as its first argument")
    flags = {"train", "training", "is_training", "deterministic", train_argument}
    for p in params[1:] if positional else params:   # all but the input (positional arguments come first)
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in flags:
            raise TypeError(f"from_flax: {type(module).__name__}.__call__ requires the argument {p.name!r}, but "
                            "from_flax passes only the input and the train flag: give it a default, or keep it in "
                            "the module (e.g. an nnx.Rngs attribute set in __init__)")


# ---------------------------------------------------------------- the equivalence check
_PROBE_KEY = 20240917  # the probe batch's seed: fixed, so a model is checked on the same inputs every time


def _check_same_network(model_name: str, forward: Callable, variables: dict, input_shape: tuple,
                        modes: Sequence[bool], rtol: float = 1e-4) -> None:
    """Refuses a model whose adapted forward pass (``forward("run", variables, x, train) -> (logits, _,
    layer outputs)``, fast paths included, no-op hooks) is not the module's own (``forward("reference",
    ...)``, Flax's code for every layer) on a probe batch x [2, *input_shape] from a fixed key:
    the logits must agree to ``rtol`` of their scale (max |logit|), in each mode of ``modes``
    (train flags). The first weight layer whose output differs is named when there is one."""
    x = jax.random.normal(jax.random.PRNGKey(_PROBE_KEY), (2,) + tuple(input_shape), jnp.float32)
    for train in modes:
        got, _, got_layers = forward("run", variables, x, train)
        want, _, want_layers = forward("reference", variables, x, train)
        got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
        scale = float(jnp.max(jnp.abs(want))) if want.size else 0.0
        diff = float(jnp.max(jnp.abs(got - want))) if want.size else 0.0
        if diff <= rtol * max(scale, 1e-6) or (not math.isfinite(scale)):
            continue
        layer = ""
        for path, out in want_layers.items():
            ref = jnp.asarray(out, jnp.float32)
            other = got_layers.get(path)
            if other is None or other.shape != ref.shape or \
                    float(jnp.max(jnp.abs(jnp.asarray(other, jnp.float32) - ref))) > rtol * max(
                        float(jnp.max(jnp.abs(ref))), 1e-6):
                layer = f" (first at layer {entry_name(path)})"
                break
        raise ValueError(f"from_flax: {model_name}'s adapted forward pass differs from the module's own in "
                         f"{'training' if train else 'evaluation'} mode by up to {diff:.3g} (logits of scale "
                         f"{scale:.3g}){layer}; try conv_impl='xla', or report it: the adapter would train a "
                         "different network")


# ---------------------------------------------------------------- the layer table
def _units(r: _Recorded) -> tuple[int, int]:
    """(in_units, out_units) of a recorded layer (see ``LayerInfo``): an Embed's are (vocabulary,
    features); a layer with several output axes has their product as out_units; a Dense/Conv's in_units
    are its input's channels (a grouped convolution's kernel holds in/groups of them)."""
    shape = r.kernel_shape
    if r.kind == "embed":
        return int(shape[0]), int(shape[-1])
    out = int(math.prod(shape[-r.out_axes:])) if r.out_axes else int(shape[-1])
    if r.kind in ("dense", "conv", "recurrent") and r.out_axes == 1:
        return int(r.in_shape[-1]), out
    return int(math.prod(shape)) // out, out


def _check_weights_seen(model_name: str, recorded: Sequence[_Recorded], params: dict) -> dict[str, tuple]:
    """Refuses, in one line, a kernel the layer table would not hold as it is: a params entry holding a
    ``kernel``/``embedding`` that no layer the adapter sees uses (ConvTranspose, OptimizedLSTMCell, a
    module multiplying by its own ``self.param('kernel')``): every mechanism would leave its weights out
    without a word; or a layer that multiplies by a kernel its stored one does not end with. Returns the
    scanned layers, {name: stored shape}: a transform stacks one kernel per repetition on leading axes
    and runs a slice per step (``nn.scan`` over layers, NNX blocks built by ``nnx.vmap`` and run by
    ``nnx.scan``)."""
    claimed = set()
    stacked: dict[str, tuple] = {}
    for r in recorded:
        name = entry_name(r.path)
        claimed.add(name)
        stored = params.get(name, {}).get("embedding" if r.kind == "embed" else "kernel")
        if stored is None or tuple(stored.shape) == tuple(r.kernel_shape):
            continue
        shape, traced = tuple(stored.shape), tuple(r.kernel_shape)
        if len(shape) > len(traced) and shape[len(shape) - len(traced):] == traced and r.kind != "embed":
            stacked[name] = shape
            continue
        raise ValueError(f"from_flax: {model_name}: layer {name} multiplies by a kernel of shape {traced} but stores "
                         f"{shape}, which is not a stack of such kernels, so the algorithms' per-layer masks and "
                         "thresholds cannot follow it: multiply by the stored kernel, or write the layer out")
    for name, leaves in params.items():
        for leaf in ("kernel", "embedding"):
            if leaf in leaves and name not in claimed:
                raise ValueError(f"from_flax: {model_name}: params entry {name} holds a {leaf} of shape "
                                 f"{tuple(leaves[leaf].shape)} that no layer the adapter sees multiplies by (it sees "
                                 "Dense/Linear, DenseGeneral/LinearGeneral (attention), Einsum, Conv, Embed and the "
                                 "Dense/Conv inside recurrent cells): every algorithm would leave these weights out; "
                                 "build the layer from those (e.g. not ConvTranspose, OptimizedLSTMCell or a "
                                 "product with a module's own self.param)")
    return stacked


def _program_flows(model_name: str, forward: Callable, variables: dict, input_shape: tuple,
                   names: Sequence[str]) -> dict:
    """{batch: ProgramFlow} of ``forward(variables, x) -> logits``, the module's own forward pass (evaluation
    mode), at batch 1 and 2: the difference of their costs is what one more example costs."""
    flows = {}
    for batch in (1, 2):
        x_aval = jax.ShapeDtypeStruct((batch,) + input_shape, jnp.float32)
        leaves = jax.tree_util.tree_flatten_with_path((variables, x_aval))[0]
        labels = [("input",) if path[0].idx == 1 else tuple(str(getattr(k, "key", k)) for k in path[1:])
                  for path, _ in leaves]
        try:
            flows[batch] = program_flow(jax.make_jaxpr(forward)(variables, x_aval).jaxpr, labels, names)
        except ValueError as e:
            if str(e).startswith("from_flax:"):
                raise
            raise ValueError(f"from_flax: {model_name}: {e}") from None
    return flows


# ---------------------------------------------------------------- the adapter
def _is_nnx(module) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax without nnx
        return False
    return isinstance(module, nnx.Module)


def from_flax(module, input_shape: Sequence[int], *, num_classes: int | None = None, name: str | None = None,
              train_argument: str | None = "auto", conv_impl: str = "auto") -> Model:
    """A ``flax.linen`` or ``flax.nnx`` module as a :class:`Model` every algorithm can train.

    Args:
      module: a ``flax.linen.Module`` (unbound) or a ``flax.nnx.Module`` (its current weights are
        the initial ones; ``init`` returns copies, so runs never touch the module's own arrays).
        ``__call__(x[, train])`` maps ``[B, *input_shape]`` float32 inputs to
        ``[B, num_classes]`` logits.
      input_shape: one example's shape, e.g. ``(28, 28, 1)`` (NHWC images) or ``(60,)``.
      num_classes: checked against the logits' width when given.
      name: the model's name in ``config.json`` and summaries (default: the class name).
      train_argument: the ``__call__`` argument that switches training mode: ``"auto"`` (the first
        of ``train``, ``training``, ``is_training``, ``deterministic`` it has), a name, or None.
      conv_impl: ``"auto"`` (im2col inside the engine's loops on CPU; elsewhere XLA's convolution, as
        batched matmuls where a vmap gives the kernel its own axis), ``"batched_im2col"``, ``"xla"``
        or ``"im2col"`` (:mod:`fedjax_sparse.models.layers`).

    Raises ``TypeError`` for what is not a Flax module instance or a ``__call__`` that needs more than
    the input and the train flag, and ``ValueError`` (one line: the problem and the fix) for a module
    that fails on ``[batch, *input_shape]`` inputs (the exception and the user's file and line), has no
    parameters, could not be built here (its weights' shapes against the device's memory, before any
    real weight is made: :func:`fedjax_sparse.core.memory.check_weights_fit`), multiplies by a kernel no seen
    layer holds or one its stored kernel is no stack of, runs products inside a ``while`` loop, asks for rng
    streams other than ``dropout`` or collections other than ``params`` and ``batch_stats``, or whose adapted
    forward pass (fast paths included) differs from its own on a probe batch (logits to 1e-4 of their scale).

    Returns a ``Model`` whose ``params`` are ``{entry: {leaf: array}}`` keyed by module path
    (``"conv1"``, ``"Block_0/Dense_0"``), whose weight layers are the module's parameterised products
    (Dense/Linear, Conv, DenseGeneral/LinearGeneral, Einsum, Embed, recurrent cells' layers) in call
    order, with MACs from the traced program (what else is derived: docs/design.md, "Your Flax model").
    """
    input_shape = shape_tuple(input_shape)
    L.resolve_conv_impl(conv_impl)  # validates the name
    nnx_module = _is_nnx(module)
    if not nnx_module:
        import flax.linen as nn
        if not isinstance(module, nn.Module):
            raise _not_a_module(module)
    call = type(module).__call__
    train_kwargs = _mode_kwargs(call, train_argument)
    _check_call_arguments(module, call, train_argument)
    init_nested, apply_nested = (_nnx_parts if nnx_module else _linen_parts)(module, train_kwargs)
    model_name = name or type(module).__name__
    x_aval = jax.ShapeDtypeStruct((2,) + input_shape, jnp.float32)

    try:
        nested0 = jax.eval_shape(lambda k: init_nested(k, jnp.zeros((1,) + input_shape, jnp.float32)),
                                 jax.random.PRNGKey(0))
    except Exception as e:  # the user's module does not build on these inputs: one line, not Flax's traceback
        raise _build_error(model_name, input_shape, e) from None
    nested0 = dict(nested0)
    if not jax.tree_util.tree_leaves(nested0.get("params", {})):
        raise ValueError(f"from_flax: {model_name} has no parameters (no Dense/Linear, Conv, DenseGeneral/"
                         "LinearGeneral, Einsum or Embed layer); the algorithms here train a model's weight layers: "
                         "give it at least one")
    # Refused from the shapes alone: nothing below is concrete until the checks make real weights (4.).
    from fedjax_sparse.core import memory
    memory.check_weights_fit(model_name, nested0)
    extra = sorted(set(nested0) - {"params", "batch_stats"})
    if extra and any(jax.tree_util.tree_leaves(nested0[c]) for c in extra):
        raise ValueError(f"from_flax: {model_name} has variable collections {extra}; only 'params' and "
                         "'batch_stats' are supported")
    paths = {entry_name(p): p for tree in (nested0["params"], nested0.get("batch_stats", {}))
             for p in _flatten(_plain(tree))}

    # An Embed's table is its entry's "kernel" in the Model's variables (the name every mechanism reads),
    # "embedding" in the module's own; filled once the layers are recorded.
    embed_entries: set = set()

    def renamed(entries: dict, old: str, new: str) -> dict:
        return {k: ({(new if leaf == old else leaf): a for leaf, a in v.items()} if k in embed_entries else v)
                for k, v in entries.items()}

    def to_nested(variables: dict) -> dict:
        params = renamed(variables["params"], "kernel", "embedding")
        out = {"params": _unflatten({paths[k]: v for k, v in params.items()})}
        stats = variables.get("batch_stats", {})
        if stats:
            out["batch_stats"] = _unflatten({paths[k]: v for k, v in stats.items()})
        return out

    def to_flat(nested: dict) -> dict:
        return renamed({entry_name(p): dict(v) for p, v in _flatten(_plain(nested)).items()}, "embedding", "kernel")

    def flat_variables(nested: dict) -> dict:
        return {"params": to_flat(nested["params"]), "batch_stats": to_flat(nested.get("batch_stats", {}))}

    # 1. Record the weight layers, their shapes, and the BatchNorms that read them.
    record = _Calls("record", conv_impl=conv_impl)
    flat0 = flat_variables(nested0)
    try:
        logits_aval = jax.eval_shape(lambda v, x: apply_nested(to_nested(v), x, record, False)[0], flat0, x_aval)
    except Exception as e:  # an NNX module first runs here (its init only reads its weights)
        if str(e).startswith("from_flax:"):
            raise
        raise _build_error(model_name, input_shape, e, alone=_runs_alone(module, input_shape, train_kwargs(False))) \
            from None
    if not record.recorded:
        raise ValueError(f"from_flax: {model_name} calls no weight layer (Dense/Linear, Conv, DenseGeneral/"
                         "LinearGeneral, Einsum, Embed); the algorithms here act on those layers' kernels")
    if len(getattr(logits_aval, "shape", ())) != 2:
        raise ValueError(f"from_flax: {model_name} must return logits [batch, classes], got "
                         f"{getattr(logits_aval, 'shape', type(logits_aval).__name__)}")
    classes = int(logits_aval.shape[-1])
    if num_classes is not None and classes != num_classes:
        raise ValueError(f"from_flax: {model_name} returns {classes} logits per example but the data has "
                         f"{num_classes} classes; set the last layer's features to {num_classes}")
    names = [entry_name(r.path) for r in record.recorded]
    bn_of = dict(record.bn_after)
    # The slowest BatchNorm decides how long the running statistics take to follow training.
    bn_momentum = max(record.bn_momentum.values(), default=Model.batch_norm_momentum)
    scanned = _check_weights_seen(model_name, record.recorded, flat0["params"])
    embed_entries.update(n for n, r in zip(names, record.recorded) if r.kind == "embed")
    flat0 = flat_variables(nested0)

    def run(mode: str, variables: dict, x, train: bool, *, hooks: Hooks = NO_HOOKS, sample_mask=None, rng=None):
        """The module on the Model's ``variables`` in ``mode`` (see ``_Calls``): (logits, its new batch_stats as
        the module nests them, each weight layer's output)."""
        calls = _Calls(mode, train=train, hooks=hooks, sample_mask=sample_mask, bn_of=bn_of, conv_impl=conv_impl,
                       rng=rng)
        logits, stats = apply_nested(to_nested(variables), x, calls, train)
        return logits, stats, calls.layer_outputs

    # 2. From the module's own program (program_flow): which layer feeds which, each layer's products (its
    # kernel's, with their contraction, and any beside it) and MACs per example; the rest is Model.other_macs.
    flows = _program_flows(model_name, lambda v, x: run("reference", v, x, False)[0], flat0, input_shape, names)
    units = [_units(r) for r in record.recorded]
    input_layers, sequential = link_layers(names, [u[0] for u in units], [u[1] for u in units],
                                           [frozenset(flows[2].layers[n].sources) for n in names],
                                           flows[2].logits_sources)
    infos = []
    other_macs = flows[2].other_macs - flows[1].other_macs
    row_leaks = []
    for r, layer_name, inp, (in_u, out_u) in zip(record.recorded, names, input_layers, units):
        one, two = flows[1].layers[layer_name], flows[2].layers[layer_name]
        side = two.side_macs - one.side_macs
        other_macs += side   # computed per example, but not by the kernel the mechanisms act on
        info = LayerInfo(layer_name, r.kind, r.kernel_shape, in_u, out_u, two.kernel_macs - one.kernel_macs, inp,
                         out_axes=r.out_axes, uses=max(two.kernel_products, 1))
        if layer_name in scanned:
            # One kernel per repetition, stacked: the mechanisms see the stored array (masks per weight); its
            # rows would span the repetitions, so it has none (out_axes 0), and its fan-in is the contraction.
            info = dataclasses.replace(info, kind="scanned", kernel_shape=scanned[layer_name], out_axes=0)
        if len(two.contractions) == 1 and next(iter(two.contractions)) != info.fan_in:
            info = dataclasses.replace(info, contraction=next(iter(two.contractions)))
        infos.append(info)
        if two.side:
            with_what = sorted({p for params in two.side for p in params})
            row_leaks.append((layer_name, "computes products beside its kernel's (with its "
                              f"{', '.join(with_what) if with_what else 'input'}), which its kernel's rows do not "
                              "reach"))
        elif r.path in record.inner:
            row_leaks.append((layer_name, f"calls layer {entry_name(record.inner[r.path])} inside its own call, "
                              "so its output does not follow its kernel's rows"))
    channel_entries = tuple((entry_name(bn), entry_name(layer)) for bn, layer in bn_of.items())

    def init_fn(key):
        return flat_variables(init_nested(key, jnp.zeros((1,) + input_shape, jnp.float32)))

    layer_names = set(names)

    def apply_fn(variables, x, *, train, hooks, sample_mask, rng):
        params = {k: ({**v, "kernel": hooks.kernel(k, v["kernel"])} if k in layer_names else v)
                  for k, v in variables["params"].items()}
        logits, stats, _ = run("run", {**variables, "params": params}, x, train, hooks=hooks, sample_mask=sample_mask,
                               rng=rng)
        return logits, to_flat(stats) if stats else dict(variables.get("batch_stats", {}))

    # 3. Training mode as the engine's local steps run it (a dropout key, statistics over the real samples):
    # a module asking for another rng stream or a cross-device BatchNorm is refused here, in one line.
    try:
        jax.eval_shape(lambda v, x, key: apply_fn(v, x, train=True, hooks=NO_HOOKS, rng=key,
                                                  sample_mask=jnp.ones((x.shape[0],), jnp.float32)),
                       flat0, x_aval, jax.random.PRNGKey(0))
    except Exception as e:
        if str(e).startswith("from_flax:"):
            raise
        raise _build_error(model_name, input_shape, e, train=True,
                           alone=_runs_alone(module, input_shape, train_kwargs(True))) from None

    # 4. Never a different network: the adapted forward pass (fast paths included) against the module's
    # own code on a probe batch, in evaluation mode and, when __call__ takes a train flag, training mode.
    check_key = jax.random.PRNGKey(_PROBE_KEY)  # dropout on in training mode, the same masks on both sides
    modes = (False, True) if train_kwargs(True) else (False,)
    # The first real weights: made once, for this check and the probes (memory.check_weights_fit's peak).
    variables = init_fn(jax.random.PRNGKey(0))
    # Every parameter and statistic moved off its initial value: a zero-initialised head would make both sides'
    # logits 0 whatever the layers before it compute.
    from fedjax_sparse.models.flax import probes as flax_probes
    probe_variables = flax_probes.perturbed(variables, set(names), _PROBE_KEY + 1)
    _check_same_network(model_name, lambda mode, v, x, train: run(mode, v, x, train, rng=check_key if train else None),
                        probe_variables, input_shape, modes)
    del probe_variables

    # 5. On a probe: padded rows change nothing for the real ones (else refused), and which layers' dropped
    # units are not zero downstream (Model.unit_drop_leaks, refused by the mechanisms that drop units).
    return flax_probes.probe(Model(model_name, input_shape, classes, tuple(infos), init_fn, apply_fn,
                                   sequential=sequential, channel_entries=channel_entries, fixed_widths=True,
                                   other_macs=other_macs, row_leaks=tuple(row_leaks),
                                   batch_norm_momentum=bn_momentum),
                             module, input_shape, variables)


def _plain(tree):
    """Flax FrozenDicts / NNX pure dicts as plain nested dicts."""
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


__all__ = ["entry_name", "from_flax", "link_layers"]
