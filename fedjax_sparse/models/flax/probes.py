"""What ``from_flax`` verifies on a probe batch beyond "the same network", on the adapted model itself
(``Model.apply`` and its hooks) with every parameter and statistic moved off its initial value (:func:`perturbed`):
a dropped unit is zero downstream (:func:`unit_drop_leaks`), padded rows change nothing for the real ones
(:func:`padding_leak`) and a pruned row computes nothing (:func:`row_leaks`). docs/design.md ("Your Flax
model") has the full description.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sparse.models.base import UNIT_ORDER, Hooks, Model

_PROBE_KEY = 20241126
_REAL, _PADDED = 3, 2          # rows of the padding probe's batch
_RTOL = 1e-5                   # of the logits' scale: the padding probe's tolerance


def _rng(train: bool):
    """The model's own randomness as local training gives it (a key; the same one for every probe run, so
    dropout masks are the same on both sides of a comparison), none in evaluation."""
    return jax.random.PRNGKey(_PROBE_KEY + 3) if train else None


def perturbed(variables: dict, kernels: set, seed: int) -> dict:
    """``variables`` with every floating leaf moved off its initial value, so that no probe is blind to a
    layer because a zero maps to zero (a zero-initialised head makes every logit 0, whatever the layers
    before it compute; a zero-initialised LoRA ``lora_b`` hides its side path): the weight layers' kernels
    (``kernels``: their entry names) by noise of their own scale (1/sqrt(fan_in) for an all-zero kernel),
    other parameters by 0.5 N(0, 1) and batch statistics by its absolute value (variances stay positive).
    NumPy's generator from ``seed``: no JAX program to compile per leaf shape."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(variables)
    out = []
    for path, leaf in leaves:
        names = [getattr(p, "key", None) for p in path]
        value = np.asarray(leaf)
        if not np.issubdtype(value.dtype, np.floating):
            out.append(leaf)
            continue
        noise = 0.5 * rng.standard_normal(value.shape)
        if names[:1] == ["params"] and names[1:2] and names[1] in kernels and names[-1] == "kernel":
            rms = float(np.sqrt(np.mean(np.square(value, dtype=np.float64)))) if value.size else 0.0
            noise *= rms if rms > 0 else 1.0 / np.sqrt(max(int(np.prod(value.shape[:-1])), 1))
        elif names[:1] == ["batch_stats"]:
            noise = np.abs(noise)
        out.append(jnp.asarray((value + noise).astype(value.dtype)))
    return jax.tree_util.tree_unflatten(treedef, out)


# ---------------------------------------------------------------- which modules run between two layers
@contextlib.contextmanager
def _recording(module, events: list):
    """While active, every Flax module call appends ``("module", path or None, class name)`` to
    ``events`` (linen: every ``__call__`` with its scope path; nnx: the classes of ``module``'s graph
    other than the layers the adapter itself intercepts, without a path)."""
    import flax.linen as nn
    if isinstance(module, nn.Module):
        def interceptor(next_fun, args, kwargs, context):
            if context.method_name == "__call__":
                m = context.module
                path = "/".join(str(p) for p in m.scope.path) if m.scope is not None else ""
                events.append(("module", path or "~", type(m).__name__))
            return next_fun(*args, **kwargs)
        with nn.intercept_methods(interceptor):
            yield
        return
    from flax import nnx
    # The classes the adapter swaps itself while tracing (its weight layers, BatchNorm, Dropout) are left alone.
    skip = tuple(getattr(nnx, n) for n in ("Linear", "Conv", "BatchNorm", "Dropout", "LinearGeneral", "Einsum", "Embed")
                 if hasattr(nnx, n))
    classes = {type(m) for _, m in nnx.iter_graph(module) if isinstance(m, nnx.Module) and not isinstance(m, skip)}
    saved = {}
    for cls in classes:
        inner = next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)
        if inner is not None:   # (own __call__ or None, the one it runs)
            saved[cls] = (cls.__dict__.get("__call__"), inner)

    def wrap(inner):
        def call(self, *a, **k):
            events.append(("module", None, type(self).__name__))
            return inner(self, *a, **k)
        return call
    try:
        for cls, (_, inner) in saved.items():
            cls.__call__ = wrap(inner)  # type: ignore[method-assign]
        yield
    finally:
        for cls, (own, _) in saved.items():
            if own is None:
                del cls.__call__
            else:
                cls.__call__ = own  # type: ignore[method-assign]


def _between(events: list, start: str | None, end: str | None, layer_names: set) -> str:
    """The modules called after layer ``start``'s output (None: from the input) and before layer
    ``end``'s output (None: the logits), as words: normalisations first when there are any."""
    i = 0
    if start is not None:
        i = next((n + 1 for n, e in enumerate(events) if e == ("layer", start)), 0)
    j = next((n for n, e in enumerate(events) if n >= i and e == ("layer", end)), len(events)) if end else len(events)
    found = []
    for kind, *rest in events[i:j]:
        if kind != "module":
            continue
        path, cls = rest
        if path is not None and (path in layer_names or path == "~" or (end is not None and end.startswith(path + "/"))
                                 or any(path.startswith(n + "/") for n in layer_names)):
            continue
        words = f"{cls} {path!r}" if path is not None else f"a {cls}"
        if (cls, words) not in found:
            found.append((cls, words))
    norms = [w for cls, w in found if "norm" in cls.lower()]
    chosen = norms or [w for _, w in found]
    if not chosen:
        return "the model's own code (no module is called there)"
    return ", ".join(chosen[:3]) + (" ..." if len(chosen) > 3 else "")


def _events_of(model: Model, module, variables: dict, x, train: bool, sample_mask) -> list:
    events: list = []

    def hook(name, h):
        events.append(("layer", name))
        return h
    with _recording(module, events):
        jax.eval_shape(lambda v, x: model.apply(v, x, train=train, hooks=Hooks(activation=hook),
                                                sample_mask=sample_mask, rng=_rng(train)), variables, x)
    return events


# ---------------------------------------------------------------- a dropped unit is zero downstream
def unit_drop_leaks(model: Model, module, variables: dict, x) -> tuple[tuple[str, str], ...]:
    """((layer, what leaks), ...): the hidden layers whose zeroed output channels reach the next weight
    layer's input as nonzero values; ``variables`` already perturbed. With every other output channel of every
    hidden layer zeroed by ``hooks.activation``, the gradient of the logits with respect to each next layer's
    kernel must be exactly zero on the rows reading a dropped channel (row ``f`` reads channel ``f % C``), in
    training and evaluation mode; a leaking layer goes into ``Model.unit_drop_leaks``, refused by the
    mechanisms that drop its units (:meth:`Model.check_unit_drops`)."""
    layers = model.layers
    dropped = {l.name: jnp.asarray(np.arange(l.out_units) % 2 == 0, jnp.float32)
               for l in layers[:-1] if l.out_units >= 2}
    by_name = {l.name: l for l in layers}
    readers = [(m, by_name[m.input_layer]) for m in layers   # (a next layer, the layer it reads)
               if m.input_layer in dropped and m.kind in ("conv", "dense") and len(m.kernel_shape) >= 2
               and m.kernel_shape[-2] == m.in_units and m.in_units % by_name[m.input_layer].out_units == 0]
    if not readers:
        return ()

    zeroed: set = set()   # the layers whose output the hook received (and zeroed): only those are checked

    def hook(name, h):
        mask = dropped.get(name)
        if mask is None or h.shape[-1] != mask.shape[0]:
            return h
        zeroed.add(name)
        return h * mask.astype(h.dtype)
    weights = jax.random.normal(jax.random.PRNGKey(_PROBE_KEY + 1), (x.shape[0], model.num_classes), jnp.float32)
    ones = jnp.ones((x.shape[0],), jnp.float32)

    def read(kernels, train):
        params = {k: ({**v, "kernel": kernels[k]} if k in kernels else v) for k, v in variables["params"].items()}
        logits, _ = model.apply({**variables, "params": params}, x, train=train, hooks=Hooks(activation=hook),
                                sample_mask=ones if train else None, rng=_rng(train))
        return jnp.sum(logits.astype(jnp.float32) * weights)
    kernels = {m.name: variables["params"][m.name]["kernel"] for m, _ in readers}
    leaks: dict[str, str] = {}
    for train in (True, False):
        grads = jax.grad(read)(kernels, train)   # op by op: a jit would compile anew for every model
        for m, src in readers:
            if src.name in leaks or src.name not in zeroed:
                continue
            g = np.abs(np.moveaxis(np.asarray(grads[m.name], np.float32), -2, 0).reshape(m.in_units, -1)).max(axis=1)
            reads_dropped = np.arange(m.in_units) % src.out_units % 2 == 1
            live = ~(g == 0)                        # NaN counts as live
            if not live[reads_dropped].any():
                continue
            mode = "training" if train else "evaluation"
            if live.sum() <= (~reads_dropped).sum() and live[~reads_dropped].sum() < (~reads_dropped).sum():
                leaks[src.name] = (f"{UNIT_ORDER}layer {m.name!r} reads the channels of layer {src.name!r} in "
                                   f"another order than channels last (its kernel row f reading channel f % "
                                   f"{src.out_units}): a transpose before the flatten (a model ported from PyTorch)?")
                continue
            between = _between(_events_of(model, module, variables, x, train, ones if train else None),
                               src.name, m.name, {l.name for l in layers})
            leaks[src.name] = (f"a unit dropped at layer {src.name!r} is not zero where layer {m.name!r} reads it "
                               f"in {mode} mode: {between} between them turns its zeros into values")
    return tuple((l.name, leaks[l.name]) for l in layers if l.name in leaks)


# ---------------------------------------------------------------- padded rows change nothing
def padding_leak(model: Model, module, variables: dict, x_real) -> str | None:
    """None when the real rows' logits and batch statistics ignore what padded rows hold (training
    mode with the sample mask, evaluation mode without), else the one-line reason (``from_flax`` refuses
    the model with it); ``variables`` already perturbed."""
    pad_shape = (_PADDED,) + tuple(x_real.shape[1:])
    fill = 5.0 + 10.0 * jax.random.normal(jax.random.PRNGKey(_PROBE_KEY + 2), pad_shape, jnp.float32)
    batches = [jnp.concatenate([x_real, jnp.zeros(pad_shape, x_real.dtype)]),
               jnp.concatenate([x_real, fill.astype(x_real.dtype)])]
    mask = jnp.asarray([1.0] * _REAL + [0.0] * _PADDED, jnp.float32)
    def run(x, train):
        outputs: dict = {}

        def hook(name, h):
            outputs.setdefault(name, h)
            return h
        logits, stats = model.apply(variables, x, train=train, hooks=Hooks(activation=hook),
                                    sample_mask=mask if train else None, rng=_rng(train))
        return logits, (stats if train else {}), outputs
    for train in (True, False):
        (a, a_stats, a_out), (b, b_stats, b_out) = [run(x, train) for x in batches]
        a, b = np.asarray(a, np.float32)[:_REAL], np.asarray(b, np.float32)[:_REAL]
        scale = max(float(np.max(np.abs(a))) if a.size else 0.0, 1e-6)
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        moved_stats = [k for k in a_stats if not _same(a_stats[k], b_stats.get(k))]
        if not (diff > _RTOL * scale or not np.isfinite(diff) or moved_stats):
            continue
        mode = "training mode (with the sample mask)" if train else "evaluation mode"
        names = [l.name for l in model.layers]
        first = next((n for n in names if n in a_out and n in b_out
                      and not _same(a_out[n][:_REAL], b_out[n][:_REAL])), None)
        seen = [n for n in names if n in a_out]   # the layers' call order
        before = seen[:seen.index(first)] if first is not None else seen
        previous = before[-1] if before else None
        events = _events_of(model, module, variables, batches[0], train, mask if train else None)
        who = _between(events, previous, first, set(names))
        where = f"before the output of layer {first!r}" if first else "after the last layer"
        what = (f"the real rows' logits by up to {diff:.3g} (of scale {scale:.3g})" if diff > _RTOL * scale
                else f"the batch statistics of {', '.join(moved_stats[:3])}")
        return (f"padded rows of a batch change {what} in {mode}: {who} {where} computes over the batch's rows; "
                "local training pads a client's last batch (count not a multiple of batch_size) and evaluation its "
                "last one, so real examples would be computed with fake ones: use flax's nn.BatchNorm / nnx.BatchNorm "
                "(from_flax passes it the sample mask and its running averages in evaluation) or statistics over "
                "real rows only")
    return None


def _same(a, b) -> bool:
    if b is None:
        return False
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for u, v in zip(la, lb):
        u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
        if u.shape != v.shape:
            return False
        tol = _RTOL * max(float(np.max(np.abs(u))) if u.size else 0.0, 1e-6)
        if u.size and not float(np.max(np.abs(u - v))) <= tol:
            return False
    return True


# ---------------------------------------------------------------- a pruned row computes nothing
def row_leaks(model: Model, variables: dict, x) -> tuple[tuple[str, str], ...]:
    """((layer, what), ...): the layers whose pruned rows still compute something from their input.

    With every other row of every layer zeroed through ``hooks.kernel`` (``variables`` perturbed), a pruned
    unit's output must be the same for every example and position (its bias, BatchNorm'd); a path beside the
    kernel (LoRA's side product, ``x @ (kernel + a @ b)``) makes it vary. Evaluation mode, outputs read by a
    callback from the activation hook (layers inside lifted transforms too); docs/design.md, "Your Flax model"."""
    rows = {l.name: l for l in model.layers if l.out_axes >= 1 and l.out_units >= 2}
    if not rows:
        return ()
    pruned = {name: np.arange(l.out_units) % 2 == 1 for name, l in rows.items()}
    # The pruned kernels and the outputs' spread are computed on the host: no JAX program to compile per shape.
    kernels = {}
    for name, layer in rows.items():
        kernel = np.asarray(variables["params"][name]["kernel"])
        kernels[name] = jnp.asarray(kernel * (~pruned[name]).reshape(kernel.shape[kernel.ndim - layer.out_axes:]))
    spread: dict[str, float] = {}
    scale: dict[str, float] = {}

    def read(name, h):
        layer = rows[name]
        flat = np.asarray(h, np.float32).reshape(-1, layer.out_units)
        units = flat[:, pruned[name]]
        spread[name] = max(spread.get(name, 0.0), float(np.max(units.max(axis=0) - units.min(axis=0))))
        scale[name] = max(scale.get(name, 0.0), float(np.max(np.abs(flat))))

    def activation(name, h):
        layer = rows.get(name)
        if layer is not None and int(np.prod(h.shape[h.ndim - layer.out_axes:])) == layer.out_units:
            jax.debug.callback(functools.partial(read, name), h)
        return h
    hooks = Hooks(kernel=lambda name, k: kernels.get(name, k), activation=activation)
    jax.block_until_ready(model.apply(variables, x, hooks=hooks)[0])
    jax.effects_barrier()
    leaks = []
    for name in rows:
        if name in spread and not spread[name] <= _RTOL * 10 * max(scale[name], 1e-6):
            leaks.append((name, f"still computes a pruned row's output from its input (it varies by up to "
                                f"{spread[name]:.3g} across examples, outputs of scale {scale[name]:.3g}, with the "
                                "row zeroed): a path beside its kernel"))
    return tuple(leaks)


def probe(model: Model, module, input_shape: tuple, variables: dict) -> Model:
    """The checks ``from_flax`` runs last: raises ``ValueError`` (one line) when padded rows move the
    real ones; returns ``model`` with ``unit_drop_leaks`` set and ``row_leaks`` completed. ``variables``:
    ``model.init(PRNGKey(0))``, which the caller has already (one copy of the weights fewer at the peak)."""
    key = jax.random.PRNGKey(_PROBE_KEY)
    variables = perturbed(variables, {l.name for l in model.layers}, _PROBE_KEY + 1)
    x = jax.random.normal(key, (_REAL,) + tuple(input_shape), jnp.float32)
    reason = padding_leak(model, module, variables, x)
    if reason is not None:
        raise ValueError(f"from_flax: {model.name}: {reason}")
    leaks = unit_drop_leaks(model, module, variables, x[:2])   # the equivalence check's batch shape
    known = dict(model.row_leaks)
    rows = tuple(model.row_leaks) + tuple(l for l in row_leaks(model, variables, x) if l[0] not in known)
    order = [l.name for l in model.layers]
    rows = tuple(sorted(rows, key=lambda l: order.index(l[0])))
    return dataclasses.replace(model, unit_drop_leaks=leaks, row_leaks=rows)


__all__ = ["padding_leak", "perturbed", "probe", "row_leaks", "unit_drop_leaks"]
