"""SpaFL (Kim, Saad, Debbah, Hong; NeurIPS 2024): federated learning of sparse
structures by sharing only one trainable threshold per neuron / conv filter.

Row i of a thresholded layer is kept iff ``mean_j |w_ij| > tau_i`` (eq. 1); clients train personal
weights and thresholds on ``CE + alpha * c(t) * sum exp(-tau)`` (eq. 5) after moving their weights by
eq. (13), and the server averages the uploaded thresholds (eq. 7). The round, the options, the
aliases, ``dense_layers`` and the cost accounting: docs/spafl.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sparse.errors import arg
from fedjax_sparse.core import accounting
from fedjax_sparse.core.algorithm import Algorithm, Task, client_metrics, cohort_mean, replicate
from fedjax_sparse.algorithms.fedavg_family import whole_state
from fedjax_sparse.algorithms.registry import register_algorithm
from fedjax_sparse.data.federated import ClientData
from fedjax_sparse.mechanisms import threshold_masks as masks_lib
from fedjax_sparse.models.base import LAYER_KINDS, Hooks, LayerInfo, Model, check_layer_kinds
from fedjax_sparse.core.training import Batch, masked_cross_entropy, model_rng, run_local_epochs

SPAFL_OPTIONS = dict(
    alpha=0.002, ramp=False, momentum=0.9, keep_optimizer_state=True, clip_norm=0.0,
    lr_decay=1.0, lr_min=0.0, ste="identity", clamp=False, eq13=True, eq13_divisor="fan_in",
    eq13_apply="sampled_before", train_weights=True, reset_threshold=True, share_thresholds=True,
    eval_thresholds="own", dense_layers="")
EQ13_DIVISORS = ("fan_in", "kernel_area")
EQ13_APPLY = ("sampled_before", "all_after")
EVAL_THRESHOLDS = ("own", "global")
# Appendix A.4: deciding directions (a sum) and updating (a sum and a multiply) per weight.
EQ13_FLOPS_PER_WEIGHT = 1.5

Thresholds = Mapping[str, jax.Array]  # layer name -> [out]


# ---------------------------------------------------------------------------- state
# Field order is the checkpoints' leaf order (docs/design.md, "Algorithm states"): never reorder.
class SpaflServerState(NamedTuple):
    """SpaFL's server state (also its broadcast). Every field is None with
    ``share_thresholds=False`` (no global thresholds: nothing is held)."""
    delta: Any        # {layer: [out]} last change of the global thresholds (eq. 13's dtau)
    history: Any      # [R, n_tau] float32 every round's flattened dtau; None unless eq13_apply="all_after"
    num_deltas: Any   # [] int32 rows of ``history`` written so far; None unless eq13_apply="all_after"
    tau: Any          # {layer: [out]} global thresholds


class SpaflClientState(NamedTuple):
    """SpaFL's client state; every leaf has a leading client axis [N, ...]."""
    batch_stats: dict   # the client's BatchNorm running statistics ({} without BatchNorm)
    kept: dict          # {layer: [N]} kept fraction of each thresholded layer in the last forward pass
    opt_state: Any      # the SGD momentum of (params, tau); None unless keep_optimizer_state
    params: dict        # the client's own weights
    synced: Any         # [N] int32 dtau rows of the history applied so far; None unless eq13_apply="all_after"
    tau: dict           # {layer: [N, out]} the client's own thresholds (those it trained last)


# ---------------------------------------------------------------------------- model structure
def thresholded_layers(model: Model) -> tuple[LayerInfo, ...]:
    """The layers SpaFL thresholds: those whose kernel ``model.apply`` passes
    through ``hooks.kernel``, found by tracing one forward pass abstractly
    (no FLOPs spent), in ``model.layers`` order."""
    seen: set[str] = set()

    def record(name, kernel):
        seen.add(name)
        return kernel

    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    x = jax.ShapeDtypeStruct((2,) + tuple(model.input_shape), jnp.float32)
    jax.eval_shape(lambda v, xx: model.apply(v, xx, train=True, hooks=Hooks(kernel=record),
                                             rng=jax.random.PRNGKey(0)), variables, x)
    unknown = seen - {layer.name for layer in model.layers}
    if unknown:
        raise ValueError(f"{model.name}: hooked kernels {sorted(unknown)} have no LayerInfo")
    return tuple(layer for layer in model.layers if layer.name in seen)


def init_thresholds(layers: tuple[LayerInfo, ...]) -> dict:
    """All thresholds start at 0 (Appendix A.1): {name: zeros [out]}."""
    return {layer.name: jnp.zeros((layer.out_units,), jnp.float32) for layer in layers}


def num_thresholds(layers: tuple[LayerInfo, ...]) -> int:
    return sum(layer.out_units for layer in layers)


def eq13_divisors(layers: tuple[LayerInfo, ...], mode: str = "fan_in") -> dict[str, float]:
    """D per layer in eq. (13): "fan_in" = c_in*kh*kw (paper's n_in);
    "kernel_area" = kh*kw for convs and in_features for linears (code)."""
    if mode not in EQ13_DIVISORS:
        raise ValueError(f"unknown eq13_divisor {mode!r}; valid: {EQ13_DIVISORS}")
    return {layer.name: float(layer.fan_in if mode == "fan_in" or layer.kind != "conv"
                              else layer.kernel_shape[0] * layer.kernel_shape[1]) for layer in layers}


# ---------------------------------------------------------------------------- pure pieces
def row_masks(params: dict, tau: Thresholds, estimator: str = "identity") -> dict:
    """{name: [out] 0/1 mask} of every thresholded layer (eq. 1)."""
    return {name: masks_lib.threshold_row_mask(params[name]["kernel"], t, estimator)
            for name, t in tau.items()}


def masking_hooks(row_mask: Mapping[str, jax.Array]) -> Hooks:
    """Hooks multiplying each thresholded kernel's rows by its mask."""
    def kernel(name, k):
        return masks_lib.apply_row_mask(k, row_mask[name]) if name in row_mask else k
    return Hooks(kernel=kernel)


def reset_layer_thresholds(tau: Thresholds, kept: Mapping[str, jax.Array]) -> dict:
    """The reset rule applied layer by layer (``kept``: {name: [] fraction})."""
    return {name: masks_lib.reset_thresholds(t, kept[name]) for name, t in tau.items()}


def kept_fractions(row_mask: Mapping[str, jax.Array]) -> dict:
    return {name: masks_lib.kept_fraction(m) for name, m in row_mask.items()}


def kept_row_counts(model: Model, row_mask: Mapping[str, jax.Array]) -> jax.Array:
    """[L] int32 kept rows of every weight layer of ``model`` (all rows when unthresholded)."""
    return jnp.stack([jnp.sum(row_mask[layer.name] > 0).astype(jnp.int32) if layer.name in row_mask
                      else jnp.int32(layer.out_units) for layer in model.layers])


def eq13_update(params: dict, delta_tau: Thresholds, divisors: Mapping[str, float]) -> dict:
    """Eq. (13): for every thresholded row i, ``w_i -= sign(sum_j w_ij) * dtau_i / D``.

    A row whose threshold rose globally (less important) shrinks towards 0,
    one whose threshold fell grows in magnitude; the direction is decided
    once per row by the sign of its weight sum."""
    new = dict(params)
    for name, dtau in delta_tau.items():
        kernel = params[name]["kernel"]
        step = jnp.sign(masks_lib.row_sum(kernel, dtau.shape[-1])) * dtau / divisors[name]
        new[name] = {**params[name], "kernel": kernel - masks_lib.broadcast_rows(step, kernel.shape)}
    return new


def flatten_thresholds(tau: Thresholds, layers: tuple[LayerInfo, ...]) -> jax.Array:
    return jnp.concatenate([tau[layer.name] for layer in layers])


def unflatten_thresholds(flat: jax.Array, layers: tuple[LayerInfo, ...]) -> dict:
    parts = jnp.split(flat, np.cumsum([layer.out_units for layer in layers])[:-1])
    return {layer.name: part for layer, part in zip(layers, parts)}


def regulariser(tau: Thresholds) -> jax.Array:
    """R = sum over all thresholds of exp(-tau) (eq. 5)."""
    return jnp.asarray(sum(jnp.sum(jnp.exp(-t)) for t in tau.values()))


def regulariser_ramp(round_index: jax.Array) -> jax.Array:
    """c(t) = sigmoid(10 t - 5): ~0.007 in round 0, ~0.99 from round 1 on."""
    return jax.nn.sigmoid(10.0 * jnp.asarray(round_index, jnp.float32) - 5.0)


# ---------------------------------------------------------------------------- setup
@dataclasses.dataclass(frozen=True)
class SpaflSetup:
    """Static facts the pure functions need (built once from model + options)."""
    model: Model
    layers: tuple[LayerInfo, ...]
    ste: str
    reset_threshold: bool
    divisors: dict
    eq13: bool
    eq13_apply: str
    share_thresholds: bool
    eval_thresholds: str
    train_weights: bool = True
    clamp: bool = False
    dense_layers: tuple[str, ...] = ()   # layers left dense (option dense_layers): no thresholds

    @property
    def replays_history(self) -> bool:
        return self.share_thresholds and self.eq13 and self.eq13_apply == "all_after"


def make_setup(model: Model, options: Mapping) -> SpaflSetup:
    """``options``: SpaFL options (e.g. ``algorithm.hparams``) -> :class:`SpaflSetup`."""
    o = {**SPAFL_OPTIONS, **{k: v for k, v in options.items() if k in SPAFL_OPTIONS}}
    for key, valid in (("ste", masks_lib.STE_ESTIMATORS), ("eq13_divisor", EQ13_DIVISORS),
                       ("eq13_apply", EQ13_APPLY), ("eval_thresholds", EVAL_THRESHOLDS)):
        if o[key] not in valid:
            raise ValueError(f"unknown {key}={o[key]!r} for SpaFL; valid: {', '.join(valid)}")
    if o["eval_thresholds"] == "global" and not o["share_thresholds"]:
        raise ValueError("eval_thresholds='global' needs share_thresholds=true (there is no global tau)")
    if not o["train_weights"] and o["eq13"] and o["share_thresholds"]:
        raise ValueError("train_weights=false freezes the weights but eq. (13) would move them; "
                         "also pass eq13=false (as spafl_thresholds_only does)")
    hooked = thresholded_layers(model)
    if not hooked:
        raise ValueError(f"model {model.name} routes no kernel through hooks.kernel: nothing to threshold")
    dense = parse_dense_layers(o["dense_layers"], model, hooked)
    # A shared layer's thresholds mask its kernel at every use, and its MACs count every use: exact.
    # A scanned layer's stacked kernel has no rows of its own (a row would span the repetitions): refused. A layer
    # kept dense is not thresholded, so neither its kind nor a path beside its kernel (Model.row_leaks) matters.
    thresholded = dataclasses.replace(model, layers=tuple(l for l in model.layers if l.name not in dense),
                                      row_leaks=tuple(l for l in model.row_leaks if l[0] not in dense))
    check_layer_kinds(thresholded, "spafl", tuple(k for k in LAYER_KINDS if k != "scanned"),
                      "thresholds each output unit (row) of every weight layer", rows=True, shared=True)
    layers = tuple(layer for layer in hooked if layer.name not in dense)
    if not layers:
        raise ValueError(f"dense_layers={o['dense_layers']!r} keeps every layer SpaFL thresholds in model "
                         f"{model.name} dense: nothing left to prune (train it with fedavg instead)")
    return SpaflSetup(model=model, layers=layers, ste=o["ste"], reset_threshold=bool(o["reset_threshold"]),
                      divisors=eq13_divisors(layers, o["eq13_divisor"]),
                      eq13=bool(o["eq13"]) and bool(o["share_thresholds"]), eq13_apply=o["eq13_apply"],
                      share_thresholds=bool(o["share_thresholds"]), eval_thresholds=o["eval_thresholds"],
                      train_weights=bool(o["train_weights"]), clamp=bool(o["clamp"]), dense_layers=dense)


def parse_dense_layers(text: str, model: Model, hooked: tuple[LayerInfo, ...]) -> tuple[str, ...]:
    """Option ``dense_layers`` ("fc2,head") -> layer names, in ``model.layers`` order; every name must
    be a layer SpaFL would threshold (``hooked``), else a one-line ValueError listing those."""
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    valid = [layer.name for layer in hooked]
    wrong = [n for n in names if n not in valid]
    if wrong:
        others = [n for n in wrong if n in {layer.name for layer in model.layers}]
        why = f" ({', '.join(others)}: not thresholded, dense already)" if others else ""
        raise ValueError(f"dense_layers={text!r}: {', '.join(wrong)} is not a layer SpaFL thresholds in model "
                         f"{model.name}{why}; valid: {', '.join(valid)}")
    return tuple(n for n in valid if n in names)


def dead_layers(setup: SpaflSetup, params: dict) -> list[str]:
    """Thresholded layers of which every row is pruned by the initial thresholds (all 0): an all-zero
    kernel, which never gets a gradient (docs/spafl.md)."""
    tau0 = init_thresholds(setup.layers)
    return [name for name, mask in row_masks(params, tau0, setup.ste).items() if not bool(jnp.any(mask > 0))]


def check_no_dead_layers(setup: SpaflSetup, model: Model, name: str = "spafl") -> None:
    """Refuses, in one line naming the layers and the fixes, a model with :func:`dead_layers` in
    ``model.init``'s weights; skipped when they are traced (a sweep checked them concretely first)."""
    with jax.ensure_compile_time_eval():
        params = model.init(jax.random.PRNGKey(0))["params"]
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(params)):
            return
        dead = dead_layers(setup, params)
    if dead:
        listed = ",".join(setup.dense_layers + tuple(dead))
        raise ValueError(
            f"{name}: layer(s) {', '.join(dead)} of model {model.name} start fully pruned (every row has "
            f"mean|w| = 0, not above its initial threshold 0: an all-zero kernel) and would never train; keep "
            f"them dense with {arg('option', f'dense_layers={listed}')}, or initialise them non-zero")


def mean_layer_density(setup: SpaflSetup, kept: Mapping[str, jax.Array]) -> jax.Array:
    """The ``density`` metric, the paper's: the mean kept fraction ({name: []}) over the thresholded
    layers and the ``dense_layers`` (each fully kept: 1)."""
    kept = {**kept, **{name: jnp.ones((), jnp.float32) for name in setup.dense_layers}}
    return jnp.mean(jnp.stack([jnp.asarray(v, jnp.float32) for v in kept.values()]))


def replay_eq13(setup: SpaflSetup, params: dict, history: jax.Array, start: jax.Array,
                stop: jax.Array) -> dict:
    """Applies the recorded global changes ``history[start:stop]`` ([R, n_tau])
    one after another with eq. (13) (``eq13_apply="all_after"``)."""
    def body(r, p):
        return eq13_update(p, unflatten_thresholds(history[r], setup.layers), setup.divisors)
    return jax.lax.fori_loop(start, stop, body, params)


def personal_params(setup: SpaflSetup, server_state: SpaflServerState, client_state: SpaflClientState) -> dict:
    """The client's current weights (with pending all-after eq. (13) updates)."""
    params = client_state.params
    if setup.replays_history:
        params = replay_eq13(setup, params, server_state.history, client_state.synced, server_state.num_deltas)
    return params


def personal_row_masks(setup: SpaflSetup, server_state: SpaflServerState, client_state: SpaflClientState) -> dict:
    """{name: [out]} masks the client's model uses at evaluation."""
    params = personal_params(setup, server_state, client_state)
    tau = server_state.tau if setup.eval_thresholds == "global" else client_state.tau
    if setup.reset_threshold:
        tau = reset_layer_thresholds(tau, client_state.kept)
    return row_masks(params, tau, setup.ste)


# ---------------------------------------------------------------------------- the local step
class SpaflCarry(NamedTuple):
    """What one local SGD step of SpaFL reads and writes."""
    trainable: dict               # {"params": weights, "tau": {layer: [out]} thresholds}
    batch_stats: dict             # BatchNorm running statistics
    opt_state: Any                # SGD momentum of (params, tau)
    kept: dict                    # {layer: []} kept fraction of each thresholded layer, last forward
    kept_row_examples: jax.Array  # [L] int32: sum over steps of kept rows x real examples (exact FLOPs)
    resets: jax.Array             # [] float32: layers whose thresholds the reset rule zeroed


def spafl_local_step(setup: SpaflSetup, optimizer: optax.GradientTransformation, lr: jax.Array,
                     reg_coeff: jax.Array, carry: SpaflCarry, batch: Batch,
                     rng: jax.Array | None = None) -> tuple[SpaflCarry, jax.Array]:
    """One step on ``CE + reg_coeff * sum exp(-tau)`` (eq. 5) of the masked model (eq. 1),
    straight-through gradients to weights and thresholds, SGD ``p -= lr * update``.
    Before the forward pass the reset rule zeroes a layer's thresholds when it kept <= 1 % of
    its rows in the previous pass. ``rng``: the model's own randomness (its dropout:
    ``training.model_rng(step_key)``). Returns (carry, the batch's cross-entropy)."""
    model = setup.model
    trainable, resets = carry.trainable, carry.resets
    tau = trainable["tau"]
    if setup.reset_threshold:
        resets = resets + sum((carry.kept[n] <= masks_lib.RESET_KEPT_FRACTION).astype(jnp.float32) for n in tau)
        tau = reset_layer_thresholds(tau, carry.kept)
        trainable = {**trainable, "tau": tau}

    def loss_fn(tr):
        row_mask = row_masks(tr["params"], tr["tau"], setup.ste)
        logits, new_stats = model.apply({"params": tr["params"], "batch_stats": carry.batch_stats}, batch.x,
                                        train=True, hooks=masking_hooks(row_mask), sample_mask=batch.mask,
                                        rng=rng)
        ce = masked_cross_entropy(logits, batch.y, batch.mask)
        return ce + reg_coeff * regulariser(tr["tau"]), (ce, new_stats, row_mask)

    (_, (ce, new_stats, row_mask)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    if not setup.train_weights:
        grads = {**grads, "params": jax.tree_util.tree_map(jnp.zeros_like, grads["params"])}
    updates, opt_state = optimizer.update(grads, carry.opt_state, trainable)
    trainable = jax.tree_util.tree_map(lambda p, u: p - lr * u, trainable, updates)
    if setup.clamp:
        params = dict(trainable["params"])
        for n in trainable["tau"]:
            params[n] = {**params[n], "kernel": jnp.clip(params[n]["kernel"], -1.0, 1.0)}
        trainable = {"params": params,
                     "tau": jax.tree_util.tree_map(lambda t: jnp.clip(t, 0.0, 1.0), trainable["tau"])}
    # Exact cost: every layer's kept rows times this batch's real examples (int32 counts).
    examples = batch.mask.sum().astype(jnp.int32)
    kept_row_examples = carry.kept_row_examples + kept_row_counts(model, row_mask) * examples
    return SpaflCarry(trainable, new_stats, opt_state, kept_fractions(row_mask), kept_row_examples, resets), ce


# ---------------------------------------------------------------------------- the algorithm
def build_spafl(task: Task, *, name: str = "spafl", alpha, ramp: bool, momentum, keep_optimizer_state,
                clip_norm, lr_decay, lr_min, ste, clamp, eq13, eq13_divisor, eq13_apply, train_weights,
                reset_threshold, share_thresholds, eval_thresholds, dense_layers="") -> Algorithm:
    model = task.model
    setup = make_setup(model, dict(
        ste=ste, reset_threshold=reset_threshold, eq13=eq13, eq13_divisor=eq13_divisor,
        eq13_apply=eq13_apply, train_weights=train_weights, share_thresholds=share_thresholds,
        eval_thresholds=eval_thresholds, clamp=clamp, dense_layers=dense_layers))
    check_no_dead_layers(setup, model, name)
    layers = setup.layers
    n_tau = num_thresholds(layers)
    comm_bits = n_tau * accounting.FLOAT_BITS if share_thresholds else 0
    eq13_flops = EQ13_FLOPS_PER_WEIGHT * sum(layer.num_weights for layer in layers)
    row_flops = accounting.row_training_flops(model)   # [L] exact training FLOPs of one row, one example
    # SGD with momentum as PyTorch does it (buf = m*buf + g; p -= lr*buf); the
    # learning rate is applied by hand so it can change per round.
    optimizer = optax.chain(*([optax.clip_by_global_norm(clip_norm)] if clip_norm else []),
                            optax.trace(decay=momentum) if momentum else optax.identity())

    def init(key):
        variables = model.init(key)
        tau0 = init_thresholds(layers)
        history = setup.replays_history
        client = SpaflClientState(
            batch_stats=variables.get("batch_stats", {}),
            kept={layer.name: jnp.ones((), jnp.float32) for layer in layers},
            opt_state=optimizer.init({"params": variables["params"], "tau": tau0}) if keep_optimizer_state else None,
            params=variables["params"], synced=jnp.zeros((), jnp.int32) if history else None, tau=tau0)
        server = SpaflServerState(None, None, None, None)
        if share_thresholds:
            server = SpaflServerState(
                delta=init_thresholds(layers),
                history=jnp.zeros((task.rounds, n_tau), jnp.float32) if history else None,
                num_deltas=jnp.zeros((), jnp.int32) if history else None, tau=tau0)
        return server, replicate(client, task.num_clients)

    def client_update(server_state: SpaflServerState, client_state: SpaflClientState, data: ClientData, ctx):
        params = client_state.params
        eq13_applied = jnp.zeros((), jnp.float32)
        synced = client_state.synced
        if share_thresholds:
            tau = server_state.tau
            if setup.eq13 and eq13_apply == "sampled_before":
                params = eq13_update(params, server_state.delta, setup.divisors)
                eq13_applied = (ctx.round > 0).astype(jnp.float32)  # dtau is 0 before the first aggregation
            elif setup.replays_history:
                params = replay_eq13(setup, params, server_state.history, client_state.synced, ctx.round)
                eq13_applied = (ctx.round - client_state.synced).astype(jnp.float32)
                synced = ctx.round.astype(jnp.int32)
        else:
            tau = client_state.tau
        trainable = {"params": params, "tau": tau}
        opt_state = client_state.opt_state if keep_optimizer_state else optimizer.init(trainable)
        lr_t = jnp.maximum(task.lr * jnp.power(lr_decay, ctx.round.astype(jnp.float32)), lr_min)
        coeff_t = alpha * (regulariser_ramp(ctx.round) if ramp else 1.0)
        carry = SpaflCarry(trainable, client_state.batch_stats, opt_state, client_state.kept,
                           jnp.zeros((len(model.layers),), jnp.int32), jnp.zeros((), jnp.float32))

        def step(carry, batch, step_index, num_steps, key):
            return spafl_local_step(setup, optimizer, lr_t, coeff_t, carry, batch, model_rng(key))
        (trainable, stats, opt_state, kept, flops, resets), local = run_local_epochs(
            step, carry, data, ctx.key, epochs=task.local_epochs, batch_size=task.batch_size,
            preprocess=task.preprocess)
        new_client = SpaflClientState(batch_stats=stats, kept=kept,
                                      opt_state=opt_state if keep_optimizer_state else None,
                                      params=trainable["params"], synced=synced, tau=trainable["tau"])
        # Density of the model the client now holds (what evaluation masks with).
        final_tau = reset_layer_thresholds(trainable["tau"], kept) if reset_threshold else trainable["tau"]
        density = mean_layer_density(setup, kept_fractions(row_masks(trainable["params"], final_tau, ste)))
        message = trainable["tau"] if share_thresholds else ()
        training = accounting.Cost.terms(row_flops, flops)
        if model.other_macs:   # products outside the weight layers (attention's scores/values): dense
            training = training + accounting.Cost.term(6 * model.other_macs, local.num_examples)
        eq13_cost = accounting.Cost.term(eq13_flops, eq13_applied.astype(jnp.int32))
        metrics = client_metrics(
            loss=local.loss, flops=training + eq13_cost, uplink_bits=comm_bits,
            downlink_bits=comm_bits, density=density, num_examples=local.num_examples,
            tau_mean=jnp.mean(flatten_thresholds(trainable["tau"], layers)), threshold_resets=resets)
        return new_client, message, metrics

    def server_update(server_state: SpaflServerState, messages, ctx):
        if not share_thresholds:
            return server_state, {}
        if getattr(ctx, "mask", None) is None:
            new_tau = jax.tree_util.tree_map(lambda t: jnp.mean(t, axis=0), messages)  # eq. (7): uniform mean
        else:   # a Poisson cohort: the uniform mean over its real clients; an empty round keeps tau (delta 0)
            new_tau = cohort_mean(messages, jnp.ones_like(ctx.weights), ctx.mask, server_state.tau)
        delta = jax.tree_util.tree_map(jnp.subtract, new_tau, server_state.tau)
        new = server_state._replace(tau=new_tau, delta=delta)
        if setup.replays_history:
            new = new._replace(history=server_state.history.at[ctx.round].set(flatten_thresholds(delta, layers)),
                               num_deltas=(ctx.round + 1).astype(jnp.int32))
        return new, {"global_tau_mean": jnp.mean(flatten_thresholds(new_tau, layers))}

    def personal_density(server_state: SpaflServerState, client_state: SpaflClientState):
        return mean_layer_density(setup, kept_fractions(personal_row_masks(setup, server_state, client_state)))

    def personal_predict(server_state: SpaflServerState, client_state: SpaflClientState, client_id, x):
        params = personal_params(setup, server_state, client_state)
        row_mask = personal_row_masks(setup, server_state, client_state)
        variables = {"params": params, "batch_stats": client_state.batch_stats}
        return model.apply(variables, x, train=False, hooks=masking_hooks(row_mask))[0]

    hparams = {"num_thresholds": n_tau, "thresholded_layers": [layer.name for layer in layers],
               "eq13_effective": setup.eq13}
    return Algorithm(name, init, whole_state, client_update, server_update,
                     personal_predict=personal_predict, global_predict=None, hparams=hparams,
                     personal_density=personal_density, varying_cohort=True)



def _spafl_unwrappable(options) -> str | None:
    """--aggregator / --attack wrap the shared thresholds; without sharing nothing is sent."""
    if options.share_thresholds:
        return None
    return "its clients send nothing (share_thresholds=false: each prunes on its own)"


def _register(name: str, description: str, paper: str, **overrides):
    defaults = {**SPAFL_OPTIONS, **overrides}

    # lr 0.01: the clients' momentum is 0.9 by default; at 0.1 SpaFL diverged on Fashion-MNIST (round 21).
    @register_algorithm(name, defaults, unwrappable=_spafl_unwrappable, description=description, paper=paper,
                        lr=0.01)
    def builder(task: Task, **options) -> Algorithm:
        return build_spafl(task, name=name, **options)
    return builder


spafl = _register("spafl", "SpaFL: trainable per-neuron thresholds, only thresholds communicated, personal "
                  "sparse weights", "Kim et al., NeurIPS 2024; docs/spafl.md")
spafl_no_eq13 = _register("spafl_no_eq13", "SpaFL without the global-threshold weight update of eq. 13",
                          "SpaFL's ablation", eq13=False)                                      # paper Table 3
spafl_thresholds_only = _register("spafl_thresholds_only", "SpaFL training only the thresholds, weights frozen",
                                  "SpaFL's ablation", train_weights=False, eq13=False)          # Table 1
spafl_local = _register("spafl_local", "SpaFL's local training alone, nothing communicated", "SpaFL's ablation",
                        share_thresholds=False, eq13=False)                                     # "Local" of Table 2
