"""Splitting a `Dataset` across simulated clients.

A partition is a list of sample indices per client, never a copy of the data.
All randomness comes from ``numpy.random.default_rng(seed)``, so a
``(dataset, spec, num_clients, seed)`` tuple always gives the same partition.
Each client's index arrays are returned sorted (int64); their order carries no
meaning, and batching code is expected to shuffle.

Specs (see `PARTITION_SCHEMES`):

``iid``
    Shuffle the train set and cut it into ``num_clients`` near-equal parts;
    the same for the test set.
``dirichlet:ALPHA``
    SpaFL / FedDrop label skew (``Non_iid_split`` in SpaFL's public code): for
    every class ``c`` draw one ``q_c ~ Dirichlet(ALPHA * 1_K)`` over the K
    clients and split the class's shuffled train samples *and* its test
    samples by the cumulative proportions of ``q_c``. Every client's test set
    therefore follows its own train label mix. Unlike SpaFL's code (which
    never redraws), everything is redrawn while some client has fewer than
    ``min_train_samples`` train samples.
``dirichlet_split:ALPHA[:TRAIN_FRACTION]``
    FSL setting: the same per-class Dirichlet split, but of the train set
    only; each client's share is then split at random into local train
    (``TRAIN_FRACTION``, default 0.8) and local test. ``test_indices`` then
    index ``dataset.train_x`` (``test_from_train=True``).
``shards:S``
    McMahan et al. (2017): sort train by label, cut it into ``num_clients*S``
    contiguous shards (sizes differ by at most one, so every sample is used;
    a shard can straddle two labels when class sizes are not multiples of the
    shard size) and give each client S random shards. Test set: every test
    sample of label ``l`` goes to one of the clients holding ``l`` in train,
    split evenly among them; labels nobody holds are unused.
``natural``
    The dataset's own client ids (``train_client_ids``/``test_client_ids``,
    e.g. ``synthetic``); ``num_clients`` must equal the number of such clients.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from fedjax_sparse.errors import arg

__all__ = [
    "PARTITION_SCHEMES",
    "Partition",
    "format_partition_report",
    "parse_partition_spec",
    "partition_dataset",
    "partition_report",
]

PARTITION_SCHEMES: dict[str, str] = {
    "iid": "iid  -- uniform random split of train and test",
    "dirichlet": "dirichlet:ALPHA  -- per-class Dirichlet(ALPHA) label skew, test follows each client's train mix",
    "dirichlet_split": (
        "dirichlet_split:ALPHA[:TRAIN_FRACTION]  -- Dirichlet(ALPHA) split of train only, "
        "each client's share split into local train/test (default 0.8)"
    ),
    "shards": "shards:S  -- sort by label, S shards per client (McMahan et al.)",
    "natural": "natural  -- the dataset's own client ids (e.g. synthetic)",
}

_VALID_FORMS = ", ".join(text.split("  --")[0] for text in PARTITION_SCHEMES.values())


@dataclasses.dataclass(frozen=True)
class Partition:
    """Per-client sample indices.

    Attributes:
      train_indices: per client, sorted int64 indices into ``dataset.train_x``.
      test_indices: per client, sorted int64 indices into ``dataset.test_x``,
        or into ``dataset.train_x`` when `test_from_train` is True.
      test_from_train: whether local test sets were carved out of the train set.
      spec: the spec string that produced this partition.
      num_classes: ``dataset.num_classes``.
    """

    train_indices: list[np.ndarray]
    test_indices: list[np.ndarray]
    test_from_train: bool
    spec: str
    num_classes: int

    @property
    def num_clients(self) -> int:
        return len(self.train_indices)


def parse_partition_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Parse a spec string into ``(scheme, params)``.

    Returns e.g. ``("dirichlet", {"alpha": 0.3})``, ``("shards", {"shards_per_client": 2})``,
    ``("dirichlet_split", {"alpha": 0.3, "train_fraction": 0.8})``, ``("iid", {})``.

    Raises:
      ValueError: one-line message listing the valid forms.
    """

    def bad(why: str) -> ValueError:
        return ValueError(f"bad partition spec '{spec}': {why}; valid forms: {_VALID_FORMS}")

    if not isinstance(spec, str):
        raise bad("expected a string")
    parts = spec.strip().split(":")
    scheme, args = parts[0].strip().lower(), [a.strip() for a in parts[1:]]

    def number(text: str, what: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise bad(f"{what} '{text}' is not a number") from None
        if not math.isfinite(value):
            raise bad(f"{what} must be finite")
        return value

    if scheme in ("iid", "natural"):
        if args:
            raise bad(f"'{scheme}' takes no parameters")
        return scheme, {}
    if scheme in ("dirichlet", "dirichlet_split"):
        max_args = 1 if scheme == "dirichlet" else 2
        if not 1 <= len(args) <= max_args:
            raise bad(f"'{scheme}' needs {'ALPHA' if max_args == 1 else 'ALPHA[:TRAIN_FRACTION]'}")
        alpha = number(args[0], "ALPHA")
        if alpha <= 0:
            raise bad(f"ALPHA must be > 0 (small = more skew, e.g. 0.1; large = near iid), got {alpha}")
        params: dict[str, Any] = {"alpha": alpha}
        if scheme == "dirichlet_split":
            frac = number(args[1], "TRAIN_FRACTION") if len(args) == 2 else 0.8
            if not 0.0 < frac < 1.0:
                raise bad(f"TRAIN_FRACTION must be in (0, 1), got {frac}")
            params["train_fraction"] = frac
        return scheme, params
    if scheme == "shards":
        if len(args) != 1:
            raise bad("'shards' needs S, the number of shards per client")
        try:
            s = int(args[0])
        except ValueError:
            raise bad(f"S '{args[0]}' is not an integer") from None
        if s < 1:
            raise bad(f"S must be >= 1, got {s}")
        return scheme, {"shards_per_client": s}
    raise bad(f"unknown scheme '{scheme}'")


# --------------------------------------------------------------------------- schemes


def _split_by_proportions(idx: np.ndarray, q: np.ndarray) -> list[np.ndarray]:
    # The cumulative-proportion cut used by SpaFL / NIID-Bench.
    return np.split(idx, (np.cumsum(q) * len(idx)).astype(int)[:-1])


# Each scheme: (rng, dataset, num_clients, min_train_samples, max_redraws, **its parse_partition_spec params)
# -> (train indices, test indices) per client.
def _iid(rng, dataset, num_clients, *_):
    train = np.array_split(rng.permutation(len(dataset.train_y)), num_clients)
    test = np.array_split(rng.permutation(len(dataset.test_y)), num_clients)
    return train, test


def _by_class_dirichlet(rng, dataset, num_clients, min_train_samples, max_redraws, alpha, train_count, splits):
    """Per class one Dirichlet(alpha) draw over the clients, redrawn until every client's
    ``train_count(pooled train count)`` is >= min_train_samples (only sizes are checked, so rejected
    draws cost no index shuffling); then each class's shuffled samples of every label array in `splits`
    are cut by it. Returns, per split, every client's indices."""
    sizes = np.bincount(dataset.train_y, minlength=dataset.num_classes)
    for _ in range(max_redraws):
        q = rng.dirichlet(np.full(num_clients, alpha), size=len(sizes))
        if not np.all(np.isfinite(q)):  # defensive: extreme alphas can underflow
            continue
        # Every client's pooled count: the sizes of the pieces _split_by_proportions will cut.
        totals = sum(np.diff((np.cumsum(q[c]) * n).astype(int)[:-1], prepend=0, append=n) for c, n in enumerate(sizes))
        if np.min(train_count(totals)) >= min_train_samples:
            break
    else:
        if min_train_samples <= 1:   # nothing to lower: every client needs a sample to train on
            raise ValueError(
                f"could not give every client a train sample in {max_redraws} Dirichlet draws (alpha={alpha}, "
                f"num_clients={num_clients}): too many clients for this alpha; raise alpha or use fewer clients"
            )
        raise ValueError(
            f"could not give every client >= {min_train_samples} train samples in {max_redraws} Dirichlet draws "
            f"(alpha={alpha}, num_clients={num_clients}); {arg('min_client_samples')} (min_train_samples) is too "
            "large for this alpha and number of clients: lower it, raise alpha, or use fewer clients"
        )
    out = [[[] for _ in range(num_clients)] for _ in splits]
    for label in range(dataset.num_classes):
        for labels, parts in zip(splits, out):
            idx = rng.permutation(np.flatnonzero(labels == label))
            for k, part in enumerate(_split_by_proportions(idx, q[label])):
                parts[k].append(part)
    return [[np.concatenate(p) for p in parts] for parts in out]


def _dirichlet(rng, dataset, num_clients, min_train_samples, max_redraws, alpha):
    return _by_class_dirichlet(rng, dataset, num_clients, min_train_samples, max_redraws, alpha, lambda t: t,
                               (dataset.train_y, dataset.test_y))


def _local_test_size(total, train_fraction: float):
    # At least one local test sample once a client has two samples, so every
    # client can be evaluated; a single sample is kept for training.
    n_test = total - np.round(train_fraction * total).astype(np.int64)
    return np.where(total >= 2, np.maximum(n_test, 1), 0)


def _dirichlet_split(rng, dataset, num_clients, min_train_samples, max_redraws, alpha, train_fraction):
    [pooled] = _by_class_dirichlet(rng, dataset, num_clients, min_train_samples, max_redraws, alpha,
                                   lambda t: t - _local_test_size(t, train_fraction), (dataset.train_y,))
    train, test = [], []
    for idx in pooled:
        idx = rng.permutation(idx)
        n_test = int(_local_test_size(len(idx), train_fraction))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return train, test


def _shards(rng, dataset, num_clients, _min_train_samples, _max_redraws, shards_per_client):
    n = len(dataset.train_y)
    num_shards = num_clients * shards_per_client
    if num_shards > n:
        raise ValueError(
            f"shards:{shards_per_client} with {num_clients} clients needs {num_shards} shards but the train set "
            f"has only {n} samples; use fewer clients or fewer shards per client"
        )
    # Shuffle before the stable label sort so each shard is a random draw within its label(s).
    perm = rng.permutation(n)
    by_label = perm[np.argsort(dataset.train_y[perm], kind="stable")]
    shards = np.array_split(by_label, num_shards)
    owner = rng.permutation(num_shards)
    train = [np.concatenate([shards[s] for s in owner[k * shards_per_client : (k + 1) * shards_per_client]])
             for k in range(num_clients)]

    c = dataset.num_classes
    holds = np.zeros((num_clients, c), bool)
    for k, idx in enumerate(train):
        holds[k, np.unique(dataset.train_y[idx])] = True
    test = [[] for _ in range(num_clients)]
    for label in range(c):
        holders = np.flatnonzero(holds[:, label])
        if len(holders) == 0:
            continue
        idx = rng.permutation(np.flatnonzero(dataset.test_y == label))
        for k, part in zip(holders, np.array_split(idx, len(holders))):
            test[k].append(part)
    test = [np.concatenate(p) if p else np.zeros(0, np.int64) for p in test]
    return train, test


def _natural(rng, dataset, num_clients, *_):
    if dataset.train_client_ids is None or dataset.test_client_ids is None:
        raise ValueError(
            f"partition 'natural' needs a naturally federated dataset with client ids; "
            f"'{dataset.name}' has none: use iid, dirichlet:ALPHA or shards:S"
        )
    ids = np.unique(dataset.train_client_ids)
    if num_clients != len(ids):
        raise ValueError(
            f"partition 'natural': dataset '{dataset.name}' has {len(ids)} natural clients, "
            f"got num_clients={num_clients}; set num_clients={len(ids)}"
        )
    train = [np.flatnonzero(dataset.train_client_ids == i) for i in ids]
    test = [np.flatnonzero(dataset.test_client_ids == i) for i in ids]
    return train, test


def partition_dataset(
    dataset,
    spec: str,
    num_clients: int,
    seed: int,
    *,
    min_train_samples: int = 1,
    max_redraws: int = 1000,
) -> Partition:
    """Split `dataset` across `num_clients` clients according to `spec`.

    Args:
      dataset: a `fedjax_sparse.data.datasets.Dataset` (only ``train_y``,
        ``test_y``, ``num_classes``, ``name`` and the client ids are used).
      spec: partition spec, see the module docstring / `PARTITION_SCHEMES`.
      num_clients: number of clients K >= 1.
      seed: seed of the numpy Generator; same inputs and seed -> same partition.
      min_train_samples: every client must end up with at least this many
        train samples; Dirichlet schemes redraw until it holds, other schemes
        raise if it cannot.
      max_redraws: Dirichlet draws tried before giving up.

    Raises:
      ValueError: bad spec or parameters, with a one-line explanation and fix.
    """
    scheme, params = parse_partition_spec(spec)
    if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    num_clients = int(num_clients)
    if min_train_samples < 0:
        raise ValueError(f"min_train_samples must be >= 0, got {min_train_samples}")
    if max_redraws < 1:
        raise ValueError(f"max_redraws must be >= 1, got {max_redraws}")
    n_train = len(dataset.train_y)
    need = num_clients * min_train_samples
    if scheme != "natural" and need > n_train:
        # No draw can work: said before any (a Dirichlet scheme would redraw max_redraws times first),
        # with the number of clients that can.
        lower = f", or a lower {arg('min_client_samples')}" if min_train_samples > 1 else ""
        raise ValueError(
            f"{num_clients} clients of at least {min_train_samples} train example{'s' * (min_train_samples != 1)} "
            f"each ({arg('min_client_samples', min_train_samples)}) need {need} train examples; the training set "
            f"has {n_train}: use at most {n_train // min_train_samples} clients ({arg('num_clients')}){lower}"
        )
    rng = np.random.default_rng(seed)
    schemes: dict[str, Callable] = {"iid": _iid, "dirichlet": _dirichlet, "dirichlet_split": _dirichlet_split,
                                    "shards": _shards, "natural": _natural}
    train, test = schemes[scheme](rng, dataset, num_clients, min_train_samples, max_redraws, **params)

    smallest = min(len(t) for t in train)
    if smallest < min_train_samples:
        raise ValueError(
            f"partition '{spec}' gives a client only {smallest} train samples (< "
            f"{arg('min_client_samples', min_train_samples)}) with {num_clients} clients on {n_train} samples; use "
            "fewer clients"
        )
    return Partition(
        train_indices=[np.sort(t).astype(np.int64) for t in train],
        test_indices=[np.sort(t).astype(np.int64) for t in test],
        test_from_train=scheme == "dirichlet_split",
        spec=spec,
        num_classes=int(dataset.num_classes),
    )


# --------------------------------------------------------------------------- reporting


def min_mean_max(values: np.ndarray) -> dict[str, float]:
    """``{"min", "mean", "max"}`` of per-client counts (min and max as ints)."""
    return {"min": int(values.min()), "mean": float(values.mean()), "max": int(values.max())}


def partition_report(dataset, partition: Partition) -> dict[str, Any]:
    """Label statistics of a partition, JSON-serialisable (plain ints/floats/lists).

    Keys: ``spec``, ``num_clients``, ``num_classes``, ``test_from_train``;
    ``clients``: per client ``{"client", "train_total", "test_total",
    "train_counts", "test_counts"}`` (counts per class); ``totals``:
    ``{"train", "test", "train_per_class", "test_per_class"}``; ``summary``:
    min/mean/max of train and test samples per client, the mean number of
    classes present in a client's train set, and the mean number of classes
    holding at least 5% of a client's train set (a skew measure that ignores
    stray samples).
    """
    c = partition.num_classes
    test_labels = dataset.train_y if partition.test_from_train else dataset.test_y
    train_counts = np.stack([np.bincount(dataset.train_y[i], minlength=c) for i in partition.train_indices])
    test_counts = np.stack([np.bincount(test_labels[i], minlength=c) for i in partition.test_indices])
    train_tot, test_tot = train_counts.sum(1), test_counts.sum(1)
    share = train_counts / np.maximum(train_tot, 1)[:, None]
    clients = [
        {
            "client": k,
            "train_total": int(train_tot[k]),
            "test_total": int(test_tot[k]),
            "train_counts": train_counts[k].tolist(),
            "test_counts": test_counts[k].tolist(),
        }
        for k in range(len(train_tot))
    ]
    return {
        "spec": partition.spec,
        "num_clients": len(train_tot),
        "num_classes": c,
        "test_from_train": partition.test_from_train,
        "clients": clients,
        "totals": {
            "train": int(train_tot.sum()),
            "test": int(test_tot.sum()),
            "train_per_class": train_counts.sum(0).tolist(),
            "test_per_class": test_counts.sum(0).tolist(),
        },
        "summary": {
            "train_samples": min_mean_max(train_tot),
            "test_samples": min_mean_max(test_tot),
            "mean_classes_per_client": float((train_counts > 0).sum(1).mean()),
            "mean_classes_over_5pct_per_client": float((share >= 0.05).sum(1).mean()),
        },
    }


def format_partition_report(report: dict[str, Any], max_rows: int = 20) -> str:
    """Render `partition_report` output as a fixed-width table (first `max_rows` clients)."""
    s = report["summary"]
    lines = [
        f"partition {report['spec']}: {report['num_clients']} clients, {report['num_classes']} classes, "
        f"{report['totals']['train']} train / {report['totals']['test']} test samples"
        + (" (local test sets carved from train)" if report["test_from_train"] else ""),
        f"train per client min/mean/max: {s['train_samples']['min']}/{s['train_samples']['mean']:.1f}/"
        f"{s['train_samples']['max']}; test: {s['test_samples']['min']}/{s['test_samples']['mean']:.1f}/"
        f"{s['test_samples']['max']}; classes per client: {s['mean_classes_per_client']:.2f} "
        f"({s['mean_classes_over_5pct_per_client']:.2f} with >=5% share)",
        "",
        f"{'client':>6}  {'train':>7}  {'test':>6}  {'classes':>7}  top labels (label:count)",
    ]
    for row in report["clients"][:max_rows]:
        counts = np.asarray(row["train_counts"])
        top = [int(i) for i in np.argsort(-counts, kind="stable")[:4] if counts[i] > 0]
        lines.append(
            f"{row['client']:>6}  {row['train_total']:>7}  {row['test_total']:>6}  "
            f"{int((counts > 0).sum()):>7}  " + " ".join(f"{i}:{counts[i]}" for i in top)
        )
    hidden = report["num_clients"] - max_rows
    if hidden > 0:
        lines.append(f"... ({hidden} more clients)")
    return "\n".join(lines)
