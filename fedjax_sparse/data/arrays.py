"""Your own data: numpy arrays or an ``.npz`` file -> a validated, partitioned dataset.

`from_arrays` (your arrays, with per-example client ids or a partition spec) and `partition` (a loaded
`Dataset`) build a `PartitionedData` (a `Dataset` plus its `Partition`; see their docstrings below).

Conventions (checked; every problem is a one-line `DataError` naming the fix):

* inputs ``[n, ...]``: ``[n, d]`` features, ``[n, H, W]`` grayscale images
  (kept as given; `build_federated_data` adds the channel axis, so
  ``input_shape`` is ``(H, W, 1)``) or ``[n, H, W, C]`` images; dtype
  ``uint8`` (pixels 0..255, scaled to 0..1 by the default ``"unit"``
  preprocessing) or any float dtype (stored as ``float32``, used as given);
  no NaN or inf;
* labels: any integer dtype, values ``0 .. num_classes - 1`` (stored as
  ``int32``); ``num_classes`` defaults to the largest label + 1;
* client ids (optional, both splits or neither): integers or strings, one per
  example. Client ``k`` is the ``k``-th smallest id (``np.unique`` order), so
  ids ``[42, 7, 42, 1000]`` become clients ``7 -> 0, 42 -> 1, 1000 -> 2`` and
  ``PartitionedData.client_names == (7, 42, 1000)``. Every client needs at
  least one training example; a client may have no test examples.

``.npz`` files: `load_npz`, or ``--dataset npz:PATH`` on the command line. The loader never guesses a
partition: client ids in a file are used only with ``--partition natural --num-clients N`` (N = number
of distinct ids). Without it a run uses ``--partition`` (default ``dirichlet:0.5``) and ignores the ids.

Example::

    from fedjax_sparse.data import from_arrays
    pdata = from_arrays(x_train, y_train, x_test, y_test, partition="dirichlet:0.3", num_clients=50)
    fed = pdata.to_federated()
    print(pdata.describe())
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_sparse.data.datasets import NPZ_PREFIX, Dataset, dataset_options, load_dataset

from fedjax_sparse.errors import DataError, DataWarning, arg, in_callers_words
from fedjax_sparse.data.federated import FederatedData, build_federated_data
from fedjax_sparse.data.partitions import Partition, min_mean_max, partition_dataset

__all__ = ["NPZ_KEYS", "NPZ_ID_KEYS", "PartitionedData", "from_arrays", "load", "load_npz", "partition"]

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
NPZ_ID_KEYS = ("client_ids_train", "client_ids_test")

_DIGEST_VERSION = b"fedjax_sparse.PartitionedData/1"
_MAX_LISTED = 5  # ids named in one error message


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionedData:
    """A `Dataset` and its `Partition` across clients.

    Attributes:
      dataset: the arrays (see the module docstring for the conventions).
      partition: per-client train/test indices into the dataset.
      client_names: when the data came with client ids, the original id of
        each client in client order (client ``k`` is ``client_names[k]``, the
        ids sorted ascending); empty otherwise.

    The arrays are not copied: do not modify them afterwards (`digest` is
    computed once and cached).
    """

    dataset: Dataset
    partition: Partition
    client_names: tuple = ()

    def __post_init__(self):
        if self.client_names and len(self.client_names) != self.partition.num_clients:
            raise DataError(
                f"{self.dataset.name}: {len(self.client_names)} client_names for "
                f"{self.partition.num_clients} clients; pass one name per client or none"
            )

    @property
    def name(self) -> str:
        return self.dataset.name

    @property
    def num_clients(self) -> int:
        return self.partition.num_clients

    @property
    def num_classes(self) -> int:
        return int(self.dataset.num_classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One model input, as in `FederatedData.input_shape` (``(H, W, 1)`` for ``[n, H, W]`` arrays)."""
        shape = self.dataset.input_shape
        return shape + (1,) if len(shape) == 2 else shape

    def to_federated(self, preprocess: str = "unit") -> FederatedData:
        """Stack the clients' index rows into device arrays (see `build_federated_data`)."""
        return _in_data_words(self.name, build_federated_data, self.dataset, self.partition, preprocess=preprocess)

    @functools.cached_property
    def _digest(self) -> str:
        h = hashlib.sha256(_DIGEST_VERSION)

        def add_array(tag: str, a: np.ndarray) -> None:
            a = np.asarray(a)
            a = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))
            h.update(f"|{tag}|{a.dtype.str}|{a.shape}|".encode())
            h.update(a.data)

        d, p = self.dataset, self.partition
        for key in ("train_x", "train_y", "test_x", "test_y"):
            add_array(key, getattr(d, key))
        h.update(f"|num_classes={int(d.num_classes)}|test_from_train={bool(p.test_from_train)}"
                 f"|num_clients={p.num_clients}|".encode())
        for k in range(p.num_clients):
            add_array(f"train{k}", np.asarray(p.train_indices[k], np.int64))
            add_array(f"test{k}", np.asarray(p.test_indices[k], np.int64))
        return h.hexdigest()

    def digest(self) -> str:
        """sha256 (hex) of the content, computed once.

        Covers the dtype, shape and bytes of ``train_x``, ``train_y``,
        ``test_x``, ``test_y``, ``num_classes``, and every client's train and
        test indices in client order; not the name, spec string or client names.
        """
        return self._digest

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary: name, digest, array shapes/dtypes, classes, clients, partition."""
        d, p = self.dataset, self.partition
        train_n = np.array([len(i) for i in p.train_indices])
        test_n = np.array([len(i) for i in p.test_indices])
        out: dict[str, Any] = {
            "name": d.name,
            "digest": self.digest(),
            "arrays": {
                key: {"shape": list(getattr(d, key).shape), "dtype": str(getattr(d, key).dtype)}
                for key in ("train_x", "train_y", "test_x", "test_y")
            },
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "num_clients": self.num_clients,
            "partition": {
                "spec": p.spec,
                "test_from_train": bool(p.test_from_train),
                "train_per_client": min_mean_max(train_n),
                "test_per_client": min_mean_max(test_n),
            },
        }
        if self.client_names:
            out["client_names"] = [n if isinstance(n, (int, str)) else str(n) for n in self.client_names]
        return out

    def __repr__(self) -> str:
        return (f"PartitionedData({self.name!r}, {self.num_clients} clients, spec={self.partition.spec!r}, "
                f"train={self.dataset.train_x.shape}, test={self.dataset.test_x.shape}, "
                f"num_classes={self.num_classes})")


# --------------------------------------------------------------------------- validation


def _as_array(value, key: str, where: str) -> np.ndarray:
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:  # ragged nested lists
        raise DataError(f"{where}: {key} is not a rectangular array ({e}); pass a numpy array [n, ...]") from None


def _check_inputs(value, key: str, where: str) -> np.ndarray:
    x = _as_array(value, key, where)
    if x.ndim < 2:
        raise DataError(
            f"{where}: {key} has shape {x.shape}, expected [n, ...] with one row per example "
            "(features [n, d], images [n, H, W] or [n, H, W, C]); for one feature per example pass x[:, None]"
        )
    if x.dtype == np.uint8:
        return x
    if x.dtype.kind != "f":
        raise DataError(
            f"{where}: {key} has dtype {x.dtype}, which is not supported; cast to uint8 or float32 "
            f"(uint8 for pixels 0..255, float32 for anything else), e.g. {key}.astype(np.float32)"
        )
    nan, inf = int(np.count_nonzero(np.isnan(x))), int(np.count_nonzero(np.isinf(x)))
    if nan or inf:
        bad = int(np.count_nonzero((~np.isfinite(x.reshape(len(x), -1))).any(axis=1)))
        raise DataError(
            f"{where}: {key} has {nan} NaN and {inf} inf value(s) in {bad} example(s); drop those "
            "examples or replace the values (e.g. np.nan_to_num) before loading"
        )
    if x.dtype != np.float32:
        with np.errstate(over="ignore"):
            x32 = x.astype(np.float32)
        if not np.isfinite(x32).all():
            raise DataError(
                f"{where}: {key} ({x.dtype}) has values beyond the float32 range (max |x| = "
                f"{float(np.abs(x).max()):.3g}); rescale the inputs"
            )
        x = x32
    return x


def _check_labels(value, key: str, where: str, n: int, x_key: str) -> np.ndarray:
    y = _as_array(value, key, where)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y.reshape(-1)
    if y.ndim != 1:
        raise DataError(
            f"{where}: {key} has shape {y.shape}, expected [n] integer class ids; "
            f"for one-hot labels pass {key}.argmax(1)"
        )
    if y.dtype.kind not in "iu":
        raise DataError(
            f"{where}: {key} has non-integer dtype {y.dtype}; labels must be integer class ids "
            f"0..C-1, e.g. {key}.astype(np.int32)"
        )
    if len(y) != n:
        raise DataError(f"{where}: {x_key} has {n} examples but {key} has {len(y)} labels; pass one label per example")
    if len(y) and y.min() < 0:
        raise DataError(
            f"{where}: {key} has negative labels (min {int(y.min())}); labels must be class ids 0..C-1: "
            "remap them, e.g. with np.unique(y, return_inverse=True)"
        )
    if len(y) and int(y.max()) >= np.iinfo(np.int32).max:
        raise DataError(f"{where}: {key} has label {int(y.max())}, too large for a class id; remap labels to 0..C-1")
    return y.astype(np.int64)


def _check_ids(value, key: str, where: str, n: int, y_key: str) -> np.ndarray:
    ids = _as_array(value, key, where)
    if ids.dtype == object:
        ids = _as_array(ids.tolist(), key, where)
    if ids.ndim != 1:
        raise DataError(f"{where}: {key} has shape {ids.shape}, expected [n] (one client id per example)")
    if ids.dtype.kind not in "iuUS":
        raise DataError(
            f"{where}: {key} has dtype {ids.dtype}; client ids must be integers or strings, "
            f"e.g. {key}.astype(np.int64)"
        )
    if len(ids) != n:
        raise DataError(f"{where}: {key} has {len(ids)} entries but {y_key} has {n}; pass one client id per example")
    return ids


def _list(values, show=lambda v: repr(v) if isinstance(v, (str, bytes)) else str(v)) -> str:
    """The first `_MAX_LISTED` values, each ``show(value)``, and how many more."""
    values = list(values)
    shown = ", ".join(map(show, values[:_MAX_LISTED]))
    return shown + (f" (and {len(values) - _MAX_LISTED} more)" if len(values) > _MAX_LISTED else "")


def _build(
    x_train, y_train, x_test, y_test, train_ids, test_ids, *, num_classes, name: str, where: str,
    id_keys: tuple[str, str],
) -> tuple[Dataset, tuple]:
    """Validated arrays -> (Dataset with int32 client codes or None, original client names)."""
    x_tr = _check_inputs(x_train, "x_train", where)
    x_te = _check_inputs(x_test, "x_test", where)
    if len(x_tr) == 0:
        raise DataError(f"{where}: x_train is empty (0 examples); pass at least one training example per client")
    if len(x_te) == 0:
        raise DataError(f"{where}: x_test is empty (0 examples); hold out some examples for evaluation")
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise DataError(
            f"{where}: x_train examples have shape {x_tr.shape[1:]} but x_test examples have "
            f"{x_te.shape[1:]}; give both splits the same example shape"
        )
    if x_tr.dtype != x_te.dtype:
        raise DataError(
            f"{where}: x_train is {x_tr.dtype} but x_test is {x_te.dtype}; give both splits the same dtype "
            "(uint8 pixels or float32 features)"
        )
    y_tr = _check_labels(y_train, "y_train", where, len(x_tr), "x_train")
    y_te = _check_labels(y_test, "y_test", where, len(x_te), "x_test")
    top = int(max(y_tr.max(), y_te.max()))
    if num_classes is None:
        num_classes = top + 1
        if num_classes < 2:
            raise DataError(f"{where}: every label is 0 (one class); pass num_classes=2 or more if the "
                            "other classes are absent from this data")
    else:
        if not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool) or num_classes < 2:
            raise DataError(f"{where}: num_classes must be an integer >= 2, got {num_classes!r}")
        num_classes = int(num_classes)
        if top >= num_classes:
            split = "y_train" if int(y_tr.max()) == top else "y_test"
            raise DataError(
                f"{where}: {split} has label {top} but num_classes={num_classes} (labels must be in "
                f"0..{num_classes - 1}); raise num_classes or remap the labels"
            )
    untrained = np.setdiff1d(np.unique(y_te), np.unique(y_tr))
    if len(untrained):
        warnings.warn(DataWarning(
            f"{where}: class(es) {_list(untrained.tolist())} appear in y_test ({int(np.isin(y_te, untrained).sum())} "
            f"examples) but in no training example: the model cannot learn them and every such test example "
            f"counts as wrong; give them training examples, drop them from the test split, or silence this with "
            f"warnings.filterwarnings('ignore', category=fedjax_sparse.errors.DataWarning)"), stacklevel=3)

    train_key, test_key = id_keys
    codes_tr = codes_te = None
    names: tuple = ()
    if (train_ids is None) != (test_ids is None):
        given, missing = (train_key, test_key) if test_ids is None else (test_key, train_key)
        raise DataError(
            f"{where}: {given} given without {missing}; pass client ids for both splits "
            "(every example needs an owner) or for neither"
        )
    if train_ids is not None:
        ids_tr = _check_ids(train_ids, train_key, where, len(y_tr), "y_train")
        ids_te = _check_ids(test_ids, test_key, where, len(y_te), "y_test")
        kind_tr, kind_te = ("int" if ids.dtype.kind in "iu" else ids.dtype.kind for ids in (ids_tr, ids_te))
        if kind_tr != kind_te:
            raise DataError(
                f"{where}: {train_key} has dtype {ids_tr.dtype} but {test_key} has {ids_te.dtype}; "
                "use the same id type (integers or strings) for both splits"
            )
        uniq, codes = np.unique(ids_tr, return_inverse=True)
        known = np.isin(ids_te, uniq)
        if not known.all():
            orphans = np.unique(ids_te[~known]).tolist()
            raise DataError(
                f"{where}: {test_key} names client(s) {_list(orphans)} with no training examples; every client "
                f"needs at least one training example: drop those test examples or give them training data"
            )
        codes_tr, codes_te = codes.reshape(-1).astype(np.int32), np.searchsorted(uniq, ids_te).astype(np.int32)
        names = tuple(uniq.tolist())
    dataset = Dataset(
        name=name,
        train_x=x_tr,
        train_y=y_tr.astype(np.int32),
        test_x=x_te,
        test_y=y_te.astype(np.int32),
        num_classes=num_classes,
        train_client_ids=codes_tr,
        test_client_ids=codes_te,
    )
    return dataset, names


def _check_min_samples(min_client_samples, where: str) -> int:
    if not isinstance(min_client_samples, (int, np.integer)) or isinstance(min_client_samples, bool) \
            or min_client_samples < 0:
        raise DataError(f"{where}: min_client_samples must be an integer >= 0, got {min_client_samples!r}")
    return int(min_client_samples)


# --------------------------------------------------------------------------- public API


def from_arrays(
    x_train,
    y_train,
    x_test,
    y_test,
    train_client_ids=None,
    test_client_ids=None,
    *,
    partition: str | None = None,
    num_clients: int | None = None,
    seed: int = 0,
    num_classes: int | None = None,
    name: str = "arrays",
    min_client_samples: int = 1,
) -> PartitionedData:
    """Validate in-memory arrays and partition them across clients.

    Args:
      x_train: training inputs ``[n, ...]``, ``uint8`` or float (see the module docstring).
      y_train: integer labels ``[n]`` of the training inputs.
      x_test: test inputs ``[m, ...]``, of the training inputs' shape and dtype.
      y_test: integer labels ``[m]`` of the test inputs.
      train_client_ids: optional owner id (int or str) of every training
        example; give test_client_ids too, or neither. With ids the partition is natural:
        client ``k`` owns the examples whose id is the ``k``-th smallest id
        (recorded in ``client_names``); ``partition`` must then be None or
        ``"natural"`` and ``num_clients`` None or the number of distinct ids.
      test_client_ids: the owner id of every test example (a client may have none).
      partition: without ids, a partition spec (``"dirichlet:0.3"``, ``"iid"``,
        ``"shards:2"``, ``"dirichlet_split:0.3"``); required then.
      num_clients: without ids, the number of clients; required then.
      seed: seed of the partition's random draws (unused with ids).
      num_classes: defaults to the largest label (train or test) + 1.
      name: the dataset's name (in messages and `PartitionedData.describe`).
      min_client_samples: every client needs at least this many training
        examples (Dirichlet specs redraw until it holds); and never fewer than one.

    Raises:
      DataError: one line naming the problem and the fix.
    """
    min_client_samples = _check_min_samples(min_client_samples, name)
    dataset, names = _build(
        x_train, y_train, x_test, y_test, train_client_ids, test_client_ids,
        num_classes=num_classes, name=name, where=name, id_keys=("train_client_ids", "test_client_ids"),
    )
    if names:
        if partition is not None and str(partition).strip().lower() != "natural":
            raise DataError(
                f"{name}: partition={partition!r} conflicts with the client ids, which define the partition; "
                "omit partition (or pass 'natural'), or drop the ids to use a spec"
            )
        if num_clients is not None and num_clients != len(names):
            raise DataError(
                f"{name}: num_clients={num_clients} but the client ids name {len(names)} clients; "
                f"omit num_clients (the ids decide it) or pass {len(names)}"
            )
        assert dataset.train_client_ids is not None
        counts = np.bincount(dataset.train_client_ids, minlength=len(names))
        small = np.flatnonzero(counts < min_client_samples)
        if len(small):
            listed = _list(small, lambda k: f"{names[k]!r} ({counts[k]})")
            raise DataError(
                f"{name}: client(s) {listed} have fewer than min_client_samples={min_client_samples} training "
                "examples; drop or merge those clients, or lower min_client_samples"
            )
        spec, k = "natural", len(names)
    else:
        if partition is None or num_clients is None:
            raise DataError(
                f"{name}: without client ids, pass partition= (e.g. 'dirichlet:0.3', 'iid', 'shards:2') and "
                "num_clients=; or pass train_client_ids and test_client_ids for a natural partition"
            )
        spec, k = partition, num_clients
    return PartitionedData(dataset, _partition(dataset, spec, k, seed, min_client_samples), names)


def _partition(dataset: Dataset, spec: str, num_clients: int, seed: int, min_client_samples: int) -> Partition:
    """`partition_dataset` in the data's words, refusing a client without training examples (possible
    only with min_client_samples=0, and never with client ids: each names a client with a train example)."""
    part = _in_data_words(dataset.name, partition_dataset, dataset, spec, num_clients, seed,
                          min_train_samples=min_client_samples)
    empty = [k for k, idx in enumerate(part.train_indices) if len(idx) == 0]
    if empty:
        raise DataError(
            f"{dataset.name}: client(s) {_list(empty)} have no training examples; use fewer clients "
            f"(at most {len(dataset.train_y)}) or a partition that gives every client data"
        )
    return part


def _in_data_words(name: str, function, *args, **kwargs):
    """``function(*args, **kwargs)``, a ValueError it raises made a DataError naming the data ``name``."""
    try:
        return function(*args, **kwargs)
    except DataError:
        raise
    except ValueError as e:
        raise DataError(f"{name}: {e}") from None


def partition(dataset: Dataset, spec: str, num_clients: int, seed: int = 0, *,
              min_client_samples: int = 1) -> PartitionedData:
    """Split a loaded `Dataset` (built-in, `load_npz` or `load`) across ``num_clients`` clients.

    ``spec`` as in `fedjax_sparse.data.partitions` (``"natural"`` uses the
    dataset's client ids). Raises `DataError` for bad specs or when a client
    would get fewer than ``max(1, min_client_samples)`` training examples.
    """
    min_client_samples = _check_min_samples(min_client_samples, dataset.name)
    return PartitionedData(dataset, _partition(dataset, spec, num_clients, seed, min_client_samples))


@in_callers_words(arguments={"download": ("download=True",) * 2, "data_dir": ("data_dir=VALUE", "data_dir"),
                             "dataset_option": ("KEYWORD", "its keyword arguments")})
def load(name: str, data_dir: str | os.PathLike | None = None, *, download: bool = False, **options) -> Dataset:
    """A built-in data set by name (`load_dataset`), or your own ``.npz`` file as ``"npz:PATH"`` (the
    path as given, relative to the current directory; `data_dir` is ignored; `load_npz`; no options)."""
    if isinstance(name, str) and name.startswith(NPZ_PREFIX):
        dataset_options(name, options)   # a .npz file has none: any is refused in the data sets' words
        if download:
            raise DataError(f"{name}: {arg('download')} does not apply to a local .npz file; drop {arg('download')}")
        path = name[len(NPZ_PREFIX):]
        if not path:
            raise DataError(f"'{name}' names no file; pass npz:PATH, e.g. npz:/data/mine.npz")
        return load_npz(path)
    return load_dataset(name, data_dir, download=download, **options)


def load_npz(path: str | os.PathLike) -> Dataset:
    """Read an ``.npz`` file of your own data into a validated `Dataset` named ``"npz:" + path``.

    Keys: ``x_train``, ``y_train``, ``x_test``, ``y_test``; optionally
    ``client_ids_train`` and ``client_ids_test`` (both or neither), stored as
    ``train_client_ids``/``test_client_ids`` ``int32`` codes ``0 .. N-1`` (sorted id
    order, as in `from_arrays`) for ``partition="natural"``; other keys are ignored. Read with
    ``allow_pickle=False``, so object arrays are refused. Write one with
    ``np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)``.

    Raises:
      DataError: missing or unreadable file, missing keys, object arrays, or
        any array problem `from_arrays` reports; the message names the path.
    """
    p = Path(path)
    where = str(path)
    save_hint = "save one with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)"
    if not p.exists():
        raise DataError(f"{where}: no such file; check the path (npz:PATH takes the path of an .npz file)")
    if p.is_dir():
        raise DataError(f"{where}: is a directory, not an .npz file; pass the path of the .npz file")
    try:
        with open(p, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise DataError(f"{where}: cannot read file ({e.strerror or e}); check the path and permissions") from None
    if magic == b"\x93NUMPY":
        raise DataError(f"{where}: is a .npy file holding one array, not an .npz archive; {save_hint}")
    if magic[:2] != b"PK":
        raise DataError(f"{where}: not an .npz file (no zip header); {save_hint}")
    arrays: dict[str, np.ndarray] = {}
    try:
        with np.load(p, allow_pickle=False) as z:
            present = list(z.files)
            missing = [k for k in NPZ_KEYS if k not in present]
            if missing:
                raise DataError(
                    f"{where}: missing key(s) {', '.join(missing)} (the file has: {', '.join(present) or 'none'}); "
                    f"{save_hint}"
                )
            for key in NPZ_KEYS + NPZ_ID_KEYS:
                if key in present:
                    try:
                        arrays[key] = z[key]
                    except ValueError as e:
                        if "pickle" in str(e).lower() or "object" in str(e).lower():
                            raise DataError(
                                f"{where}: array '{key}' holds Python objects, which are not loaded "
                                "(allow_pickle=False, for safety); save numeric or string arrays, e.g. "
                                f"{key}.astype(np.float32)"
                            ) from None
                        raise
    except DataError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise DataError(f"{where}: damaged or truncated .npz file ({type(e).__name__}: {e}); "
                        f"re-create it ({save_hint})") from None
    dataset, _ = _build(
        arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
        arrays.get("client_ids_train"), arrays.get("client_ids_test"),
        num_classes=None, name=f"npz:{path}", where=where, id_keys=NPZ_ID_KEYS,
    )
    return dataset
