"""Evaluation of a federated state: personalised accuracy (every client on its own test set, with its
personal model when the algorithm has one, else the global model) and global accuracy (the global model
on the union of the clients' test sets). ``per_client`` makes one jitted call per client; without a
personal model one ``shared_pass`` of the global model gives both (same counts, tested). How and the
measurements: docs/design.md, "Evaluation".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sparse.core.algorithm import Algorithm
from fedjax_sparse.data.federated import FederatedData
from fedjax_sparse.models import layers as L

PERSONAL_EVAL_MODES = ("auto", "per_client")


class EvalStats(NamedTuple):
    correct: jax.Array   # [] float32
    loss_sum: jax.Array  # [] float32
    count: jax.Array     # type: ignore[assignment]  # [] int32 (shadows tuple.count; a public field)


def resolve_personal_eval(mode: str) -> str:
    """``auto``: per_client, the fastest recorded (docs/design.md, "Execution modes")."""
    return "per_client" if mode == "auto" else mode


def hits_and_losses(logits: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, C] logits, [B] labels -> ([B] float32 correctness, [B] cross-entropy)."""
    return ((jnp.argmax(logits, -1) == y).astype(jnp.float32),
            optax.softmax_cross_entropy_with_integer_labels(logits, y))


def personal_summary(correct, loss_sum, count) -> dict:
    """Per-client hits, loss sums and test counts [N] -> accuracy mean / std / min / max over the
    clients with test data, their pooled test loss and the per-client accuracies."""
    count = np.asarray(count, np.float64)
    has = count > 0
    acc = np.asarray(correct, np.float64)[has] / count[has]
    return {"accuracy": float(acc.mean()), "accuracy_std": float(acc.std()), "accuracy_min": float(acc.min()),
            "accuracy_max": float(acc.max()),
            "test_loss": float(np.asarray(loss_sum, np.float64)[has].sum() / count[has].sum()),
            "client_accuracies": acc}


def _totals(hits: np.ndarray, losses: np.ndarray) -> EvalStats:
    """Summed (in float64) per-example hits and losses as EvalStats."""
    return EvalStats(jnp.asarray(hits.sum(dtype=np.float64)), jnp.asarray(losses.sum(dtype=np.float64)),
                     jnp.asarray(len(hits)))


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """Jitted evaluation of an algorithm's state on a FederatedData (see the module docstring)."""
    algorithm: Algorithm
    num_clients: int
    eval_batch_size: int = 500
    eval_shared_global_pass: bool = True
    personal_eval: str = "auto"
    # Smallest batch of the global model's pass over the union of the test sets.
    global_batch_size: int = 512
    # per_client: test sets padded to a multiple of this (fewer shapes to compile vs less padding).
    per_client_granularity: int = 32

    def __post_init__(self):
        if self.personal_eval not in PERSONAL_EVAL_MODES:
            raise ValueError(f"unknown personal_eval {self.personal_eval!r}; valid: {PERSONAL_EVAL_MODES}")

    @property
    def global_eval_batch_size(self) -> int:
        """Batch of the passes over the union of the test sets: ``eval_batch_size`` is sized for one
        client's small test set, far too small for thousands of examples."""
        return max(self.eval_batch_size, self.global_batch_size)

    def predict_for(self, server, client_state, cid) -> Callable[[jax.Array], jax.Array]:
        """Client ``cid``'s predict: its personal model's, else the global model's."""
        alg = self.algorithm
        if alg.personal_predict is not None:
            return functools.partial(alg.personal_predict, server, client_state, cid)
        assert alg.global_predict is not None
        return functools.partial(alg.global_predict, server)

    # ---------------------------------------------------------------- jitted pieces
    @functools.cached_property
    def _global_batch_fn(self):
        """(server, data, start) -> ([B] hits, [B] losses) of the global model on rows
        ``start .. start+B`` of the union of the test sets (zero past its end), called once per batch
        from the host (traced outside any loop, ``models.layers.outside_loops``: docs/design.md)."""
        alg = self.algorithm
        size = self.global_eval_batch_size

        def batch(server, data: FederatedData, start):
            rows = jnp.pad(data.global_test_idx, (0, size))
            rows = jax.lax.dynamic_slice_in_dim(rows, start, size)
            x = data.preprocess(data.test_x[rows])
            y = data.test_y[rows]
            with L.outside_loops():
                logits = alg.global_predict(server, x)
            valid = ((start + jnp.arange(size)) < data.global_test_idx.shape[0]).astype(jnp.float32)
            hits, losses = hits_and_losses(logits, y)
            return hits * valid, losses * valid
        return jax.jit(batch)

    def global_examples(self, state, data: FederatedData) -> tuple[np.ndarray, np.ndarray]:
        """Per-example ([M] hits, [M] losses) of the global model over the union of the test sets
        (``data.global_test_idx``, M rows), float32 on the host."""
        m = int(data.global_test_idx.shape[0])
        size = self.global_eval_batch_size
        pending = [self._global_batch_fn(state.server, data, jnp.int32(start)) for start in range(0, m, size)]
        hits, losses = (np.concatenate(part)[:m] for part in zip(*jax.device_get(pending)))
        return hits, losses

    def global_stats(self, state, data: FederatedData) -> EvalStats:
        """The global model's EvalStats over the union of the test sets (host numbers)."""
        return _totals(*self.global_examples(state, data))

    def shared_pass(self, state, data: FederatedData) -> tuple[EvalStats, EvalStats]:
        """Personal stats of a model shared by all clients, and the global stats, from one pass of the
        global model over the union of the test sets: per-example hits and losses are scattered to
        the pool rows and gathered per client (host numpy)."""
        hits, losses = self.global_examples(state, data)
        rows = np.asarray(data.global_test_idx)
        pool = int(data.test_y.shape[0])
        hit_of_row, loss_of_row = np.zeros((2, pool), np.float64)
        hit_of_row[rows], loss_of_row[rows] = hits, losses
        test_idx, counts = np.asarray(data.test_idx), np.asarray(data.test_count)
        valid = np.arange(test_idx.shape[1]) < counts[:, None]
        personal = EvalStats(jnp.asarray((hit_of_row[test_idx] * valid).sum(1)),
                             jnp.asarray((loss_of_row[test_idx] * valid).sum(1)), jnp.asarray(counts))
        return personal, _totals(hits, losses)

    @functools.cached_property
    def _per_client_fn(self):
        """(state, data, cid, width) -> (hits, loss sum) of client ``cid`` on its test set, whose
        rows are padded to ``width``; one compile per width."""
        def one(state, data: FederatedData, cid, width: int):
            client_state = jax.tree_util.tree_map(lambda x: x[cid], state.clients)
            idx = data.test_idx
            if idx.shape[1] < width:
                idx = jnp.pad(idx, ((0, 0), (0, width - idx.shape[1])))
            rows = jax.lax.dynamic_index_in_dim(idx, cid, 0, keepdims=False)[:width]
            x = data.preprocess(data.test_x[rows])
            y = data.test_y[rows]
            with L.outside_loops():
                logits = self.predict_for(state.server, client_state, cid)(x)
            valid = (jnp.arange(width) < data.test_count[cid]).astype(jnp.float32)
            hits, losses = hits_and_losses(logits, y)
            return (hits * valid).sum(), (losses * valid).sum()
        return jax.jit(one, static_argnums=3)

    @functools.cached_property
    def _density_fn(self):
        """jitted state -> [] mean over all N clients of the density of the model each holds."""
        density = self.algorithm.personal_density
        assert density is not None, "only for algorithms with personal_density"

        def all_clients(state):
            return jnp.mean(jax.lax.map(lambda c: density(state.server, c), state.clients))
        return jax.jit(all_clients)

    # ---------------------------------------------------------------- host side
    def personal_stats(self, state, data: FederatedData) -> EvalStats:
        """[N] per-client EvalStats (host numpy), one call per client (module docstring)."""
        counts = np.asarray(jax.device_get(data.test_count))
        g = self.per_client_granularity
        ids = np.flatnonzero(counts > 0)
        # Dispatched one after another without waiting; fetched together.
        pending = [self._per_client_fn(state, data, jnp.int32(c), int(-(-counts[c] // g) * g)) for c in ids]
        correct, loss_sum = np.zeros((2, self.num_clients), np.float64)
        correct[ids], loss_sum[ids] = np.reshape(jax.device_get(pending), (-1, 2)).T   # the fetched pairs' columns
        return EvalStats(jnp.asarray(correct), jnp.asarray(loss_sum), jnp.asarray(counts))

    def evaluate(self, state, data: FederatedData) -> dict:
        """Personalised accuracy (each client on its own test set; clients
        without test data are skipped) and global-model accuracy on the union of
        the clients' test sets (None without a global model)."""
        alg = self.algorithm
        g: EvalStats | None
        if alg.personal_predict is None and alg.global_predict is not None and self.eval_shared_global_pass:
            stats, g = self.shared_pass(state, data)
        else:
            stats = self.personal_stats(state, data)
            g = None if alg.global_predict is None else self.global_stats(state, data)
        out = {**personal_summary(stats.correct, stats.loss_sum, stats.count), "global_accuracy": None}
        if g is not None:
            out["global_accuracy"] = float(g.correct / max(int(g.count), 1))
            out["global_test_loss"] = float(g.loss_sum / max(int(g.count), 1))
        if alg.personal_density is not None:
            # The authors' logs average the density over every client, sampled or not.
            out["density_all_clients"] = float(self._density_fn(state))
        return out
