"""Stacked client data: the images once, in their compact dtype (uint8), and each client a padded row of
indices into them plus its count (how a round reads them: docs/design.md, end of "Replicas"; the cost:
docs/scaling.md).

Shapes: ``train_idx [N, max_train] int32`` (padding = 0, never read as data:
every consumer masks positions >= count), ``train_count [N] int32``.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PREPROCESSING = ("unit", "raw", "standardize")


class ClientData(NamedTuple):
    """One client's view inside jitted code (x/y are the shared pool)."""
    x: jax.Array        # [n_pool, ...] uint8 or float32, shared by all clients
    y: jax.Array        # [n_pool] int32
    indices: jax.Array  # [max_n] int32, only the first ``count`` are valid
    count: jax.Array    # type: ignore[assignment]  # [] int32 (shadows tuple.count; a public field)


@struct.dataclass
class FederatedData:
    """Device arrays of a partitioned dataset (see module docstring); a pytree
    whose leaves are the arrays, so it is passed into jitted code as an argument
    (never baked in as a constant)."""
    train_x: jax.Array
    train_y: jax.Array
    train_idx: jax.Array
    train_count: jax.Array
    test_x: jax.Array
    test_y: jax.Array
    test_idx: jax.Array
    test_count: jax.Array
    global_test_idx: jax.Array  # [M] int32: the union of the clients' test rows
    num_classes: int = struct.field(pytree_node=False)
    input_shape: tuple[int, ...] = struct.field(pytree_node=False)
    preprocess_name: str = struct.field(pytree_node=False, default="unit")
    mean: float = struct.field(pytree_node=False, default=0.0)
    std: float = struct.field(pytree_node=False, default=1.0)

    @property
    def num_clients(self) -> int:
        return int(self.train_idx.shape[0])

    def __repr__(self) -> str:  # the default one prints every array
        return (f"FederatedData({self.num_clients} clients, {self.train_x.shape[0]} train / "
                f"{self.test_x.shape[0]} test examples of shape {tuple(self.input_shape)}, "
                f"{self.num_classes} classes, preprocess={self.preprocess_name!r})")

    def preprocess(self, x: jax.Array) -> jax.Array:
        """Raw pool samples -> float32 model inputs."""
        x = x.astype(jnp.float32)
        if self.preprocess_name == "raw":
            return x
        if self.preprocess_name == "unit":
            return x / 255.0 if self.train_x.dtype == jnp.uint8 else x
        return (x - self.mean) / self.std


def pad_index_rows(index_lists, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """list of N int arrays -> (rows [N, max_n] int32 zero-padded, counts [N] int32)."""
    counts = np.array([len(ix) for ix in index_lists], np.int32)
    width = max(int(counts.max(initial=0)), 1) if pad_to is None else pad_to
    rows = np.zeros((len(index_lists), width), np.int32)
    for i, ix in enumerate(index_lists):
        rows[i, :len(ix)] = ix
    return rows, counts


def build_federated_data(dataset, partition, *, preprocess: str = "unit") -> FederatedData:
    """Dataset + Partition (see fedjax_sparse.data.partitions) -> FederatedData."""
    if preprocess not in PREPROCESSING:
        raise ValueError(f"unknown preprocessing {preprocess!r}; valid: {PREPROCESSING}")
    with_channel = lambda x: x[..., None] if x.ndim == 3 else x   # grayscale without a channel axis
    train_x = with_channel(np.asarray(dataset.train_x))
    test_x_src = train_x if partition.test_from_train else with_channel(np.asarray(dataset.test_x))
    test_y_src = dataset.train_y if partition.test_from_train else dataset.test_y
    train_idx, train_count = pad_index_rows(partition.train_indices)
    test_idx, test_count = pad_index_rows(partition.test_indices)
    if (train_count == 0).any():
        empty = np.flatnonzero(train_count == 0)[:5].tolist()
        raise ValueError(f"clients {empty} have no training samples; use fewer clients or a "
                         "partition with a minimum size (e.g. larger Dirichlet alpha)")
    scale = 255.0 if train_x.dtype == np.uint8 else 1.0
    used = np.concatenate([np.asarray(ix) for ix in partition.train_indices])
    sample = train_x[used[:: max(1, len(used) // 20000)]].astype(np.float64) / scale
    mean, std = float(sample.mean()), float(sample.std() + 1e-8)
    if preprocess == "standardize":
        # Stored in raw units so preprocess() is one fused subtract/divide.
        mean, std = mean * scale, std * scale
    return FederatedData(
        train_x=jnp.asarray(train_x), train_y=jnp.asarray(np.asarray(dataset.train_y, np.int32)),
        train_idx=jnp.asarray(train_idx), train_count=jnp.asarray(train_count),
        test_x=jnp.asarray(test_x_src), test_y=jnp.asarray(np.asarray(test_y_src, np.int32)),
        test_idx=jnp.asarray(test_idx), test_count=jnp.asarray(test_count),
        global_test_idx=jnp.asarray(np.unique(np.concatenate(
            [np.asarray(ix, np.int64) for ix in partition.test_indices] + [np.zeros(0, np.int64)])).astype(np.int32)),
        num_classes=int(dataset.num_classes), input_shape=tuple(train_x.shape[1:]),
        preprocess_name=preprocess, mean=mean, std=std)

