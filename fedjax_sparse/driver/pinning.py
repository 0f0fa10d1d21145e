"""Pinned random draws: replay another implementation's partition, initial
weights and client-sampling sequence exactly (``--partition-file``,
``--init-params``, ``--cohort-schedule``). The three file formats are in
docs/running.md, "Pinned draws".
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from flax import traverse_util

from fedjax_sparse.errors import PinningError, arg

PARTITION_FORMAT = "fedjax_sparse.partition/1"
COHORTS_FORMAT = "fedjax_sparse.cohorts/1"


def file_digest(path: str | Path) -> str:
    """sha256 of a file (recorded in config.json so a replay can be checked)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _read_json(path: str | Path, flag: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise PinningError(f"{flag} {path}: no such file; pass the path of an existing file")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PinningError(f"{flag} {path} is not valid JSON ({e}); regenerate the file") from None


# ---------------------------------------------------------------- partition
def partition_to_json(partition, *, dataset: str, seed: int | None = None, report: Mapping | None = None) -> dict:
    """A ``fedjax_sparse.partition/1`` document for a :class:`~fedjax_sparse.data.partitions.Partition`
    (``report``: optional label statistics merged per client)."""
    clients = []
    for k, (train, test) in enumerate(zip(partition.train_indices, partition.test_indices)):
        entry = dict(report["clients"][k]) if report is not None else {"client": k}
        entry.update(client=k, train_indices=[int(i) for i in train], test_indices=[int(i) for i in test])
        clients.append(entry)
    doc = {"format": PARTITION_FORMAT, "dataset": dataset, "seed": seed, "spec": partition.spec,
           "num_clients": partition.num_clients, "num_classes": partition.num_classes,
           "test_from_train": bool(partition.test_from_train)}
    if report is not None:
        doc.update({k: v for k, v in report.items() if k not in doc and k != "clients"})
    doc["clients"] = clients
    return doc


def load_partition_file(path: str | Path, dataset, num_clients: int):
    """Reads a partition file for ``dataset`` (a loaded Dataset) and checks it:
    ``num_clients`` clients, indices in range, no client without training data."""
    from fedjax_sparse.data.partitions import Partition
    flag = arg("partition_file")
    doc = _read_json(path, flag)
    if not isinstance(doc, dict) or doc.get("format") != PARTITION_FORMAT or not isinstance(doc.get("clients"), list):
        raise PinningError(f"{flag} {path} is not a {PARTITION_FORMAT} file (a JSON object with "
                           f"\"format\": \"{PARTITION_FORMAT}\" and a \"clients\" list); "
                           "see docs/running.md, \"Pinned draws\"")
    name = doc.get("dataset")
    if name is not None and name != dataset.name:
        raise PinningError(f"{flag} {path} partitions dataset {name!r}, but {arg('dataset')} is {dataset.name!r}")
    clients = doc["clients"]
    if len(clients) != num_clients:
        raise PinningError(f"{flag} {path} has {len(clients)} clients, but {arg('num_clients')} is {num_clients}; "
                           f"pass {arg('num_clients', len(clients))}")
    test_from_train = bool(doc.get("test_from_train", False))
    n_train, n_test = len(dataset.train_y), len(dataset.test_y)
    train, test = [], []
    for k, client in enumerate(clients):
        try:
            tr = np.asarray(client["train_indices"], np.int64).reshape(-1)
            te = np.asarray(client["test_indices"], np.int64).reshape(-1)
        except (KeyError, TypeError, ValueError):
            raise PinningError(f"{flag} {path}: client {k} needs integer lists \"train_indices\" and "
                               "\"test_indices\"") from None
        for what, idx, limit in (("train", tr, n_train), ("test", te, n_train if test_from_train else n_test)):
            if idx.size and (idx.min() < 0 or idx.max() >= limit):
                raise PinningError(f"{flag} {path}: client {k} has {what} index {int(idx.max())} outside "
                                   f"[0, {limit}) of {dataset.name}'s {what if not test_from_train else 'train'} set")
        if tr.size == 0:
            raise PinningError(f"{flag} {path}: client {k} has no training samples")
        train.append(np.sort(tr))
        test.append(np.sort(te))
    spec = doc.get("spec") or f"file:{Path(path).name}"
    return Partition(train_indices=train, test_indices=test, test_from_train=test_from_train,
                     spec=f"file:{Path(path).name} ({spec})" if not str(spec).startswith("file:") else spec,
                     num_classes=int(dataset.num_classes))


# ---------------------------------------------------------------- initial parameters
def save_init_params(variables: Mapping, path: str | Path) -> None:
    """Writes ``variables`` as an ``--init-params`` file."""
    arrays = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(variables, sep="/").items()}
    # numpy's stub confuses **kwds with allow_pickle
    np.savez(Path(path), **arrays)  # type: ignore[arg-type]


def load_init_params(path: str | Path, template: Mapping, *,
                     extra_prefixes: tuple[str, ...] = ("scores/",)) -> tuple[dict, dict]:
    """Reads an ``--init-params`` file shaped like ``template`` (the model's
    variables, arrays or ShapeDtypeStructs). Returns (variables, extras) where
    extras holds the arrays under ``extra_prefixes`` (FSL scores)."""
    flag = arg("init_params")
    path = Path(path)
    if not path.is_file():
        raise PinningError(f"{flag} {path}: no such file; pass the path of an existing .npz file")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise PinningError(f"{flag} {path} is not a readable .npz file ({e}); regenerate it with "
                           "fedjax_sparse.driver.pinning.save_init_params") from None
    # {"params": {"conv1": {"kernel": x}}} -> {"params/conv1/kernel": x} (empty dicts vanish).
    expected = traverse_util.flatten_dict(template, sep="/")
    missing = sorted(set(expected) - set(arrays))
    unknown = sorted(k for k in set(arrays) - set(expected) if not k.startswith(extra_prefixes))
    if missing or unknown:
        raise PinningError(f"{flag} {path} does not match the model: missing {missing[:6]}, unexpected "
                           f"{unknown[:6]}; the model's variables are {sorted(expected)}")
    for key, ref in expected.items():
        if tuple(arrays[key].shape) != tuple(ref.shape):
            raise PinningError(f"{flag} {path}: {key} has shape {tuple(arrays[key].shape)}, the model needs "
                               f"{tuple(ref.shape)} (layouts: conv HWIO, dense [in, out]; "
                               "see docs/running.md, \"Pinned draws\")")
        if not np.all(np.isfinite(arrays[key])):
            raise PinningError(f"{flag} {path}: {key} holds NaN or inf values")
    variables = traverse_util.unflatten_dict({key: arrays[key].astype(ref.dtype) for key, ref in expected.items()},
                                             sep="/")
    for top in template:   # keep empty collections such as batch_stats = {}
        variables.setdefault(top, {})
    extras = {k: v for k, v in arrays.items() if k.startswith(extra_prefixes)}
    return variables, extras


def params_from_torch(model, state_dict: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict:
    """Converts a PyTorch state dict (numpy arrays or tensors) to this project's
    ``{"params": ...}`` layout for ``model``.

    ``names`` maps each project layer name to the PyTorch module prefix (e.g.
    ``{"conv1": "conv1", "fc1": "fc3"}``); by default the i-th weight layer of
    ``model.layers`` takes the i-th ``*.weight`` of 2 or 4 dimensions in the
    state dict's order. Conv weights OIHW -> HWIO; linear ``[out, in]`` ->
    ``[in, out]``, with the rows of a linear fed by a flattened conv map
    reordered from PyTorch's (c, h, w) flattening to the project's (h, w, c).
    Biases are copied. Other entries (BatchNorm, thresholds) are ignored."""
    def arr(x):
        return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, np.float32)

    for layer in model.layers:
        if layer.kind not in ("dense", "conv"):
            raise PinningError(f"{layer.name}: a layer of kind {layer.kind!r} (kernel {tuple(layer.kernel_shape)}); "
                               "PyTorch weights convert to dense and conv layers only (an embedding, an attention "
                               "projection or a recurrent cell has its own layout): convert that layer yourself and "
                               f"pass the variables as an .npz keyed by path ({arg('init_params')})")
    if names is None:
        weights = [k for k, v in state_dict.items() if k.endswith(".weight") and arr(v).ndim in (2, 4)]
        if len(weights) != len(model.layers):
            raise PinningError(f"the state dict has {len(weights)} conv/linear weights, model {model.name} has "
                               f"{len(model.layers)} layers; pass names= explicitly")
        names = {layer.name: w[:-len(".weight")] for layer, w in zip(model.layers, weights)}
    params = {}
    for layer in model.layers:
        prefix = names[layer.name]
        w = arr(state_dict[f"{prefix}.weight"])
        if layer.kind == "conv":
            kernel = w.transpose(2, 3, 1, 0)
        else:
            kernel = w.T
            source = model.layer(layer.input_layer) if layer.input_layer else None
            if source is not None and source.kind == "conv" and layer.in_units != source.out_units:
                channels = source.out_units
                positions = layer.in_units // channels
                side = math.isqrt(positions)
                if side * side * channels != layer.in_units:
                    raise PinningError(f"{layer.name}: cannot infer the square conv map feeding it")
                kernel = (w.reshape(w.shape[0], channels, side, side).transpose(2, 3, 1, 0)
                          .reshape(layer.in_units, w.shape[0]))
        if tuple(kernel.shape) != tuple(layer.kernel_shape):
            raise PinningError(f"{layer.name}: converted kernel {kernel.shape} != model kernel {layer.kernel_shape}")
        params[layer.name] = {"kernel": kernel}
        if f"{prefix}.bias" in state_dict:
            params[layer.name]["bias"] = arr(state_dict[f"{prefix}.bias"])
    return {"params": params}


# ---------------------------------------------------------------- cohort schedule
def load_cohort_schedule(path: str | Path, *, num_clients: int, clients_per_round: int, rounds: int) -> np.ndarray:
    """Reads a cohort schedule: [R, K] int32 with R >= ``rounds``, K = ``clients_per_round``,
    distinct ids in [0, ``num_clients``) in every row."""
    flag = arg("cohort_schedule")
    doc = _read_json(path, flag)
    if not isinstance(doc, dict) or doc.get("format") != COHORTS_FORMAT or not isinstance(doc.get("rounds"), list):
        raise PinningError(f"{flag} {path} is not a {COHORTS_FORMAT} file (a JSON object with "
                           f"\"format\": \"{COHORTS_FORMAT}\" and a \"rounds\" list of client-id lists)")
    rows = doc["rounds"]
    if len(rows) < rounds:
        raise PinningError(f"{flag} {path} lists {len(rows)} rounds but {arg('rounds')} is {rounds}; "
                           f"lower {arg('rounds')} to {len(rows)} or extend the schedule")
    for r, row in enumerate(rows):
        if (not isinstance(row, list) or len(row) != clients_per_round
                or not all(isinstance(c, int) and not isinstance(c, bool) for c in row)):
            raise PinningError(f"{flag} {path}: round {r} must list exactly {arg('clients_per_round')} = "
                               f"{clients_per_round} integer client ids, got {str(row)[:80]}")
        if len(set(row)) != len(row) or min(row) < 0 or max(row) >= num_clients:
            raise PinningError(f"{flag} {path}: round {r} needs distinct client ids in [0, {num_clients}), "
                               f"got {row}")
    return np.asarray(rows, np.int32)


def write_cohort_schedule(schedule, path: str | Path) -> None:
    """Writes [R, K] client ids as a cohort-schedule file."""
    rows = [[int(c) for c in row] for row in np.asarray(schedule)]
    Path(path).write_text(json.dumps({"format": COHORTS_FORMAT, "rounds": rows}))
