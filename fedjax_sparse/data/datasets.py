"""Dataset loading: original on-disk formats -> one in-memory `Dataset`, whose docstring gives the
conventions every loader keeps (so model and partition code never needs to know where data came from).

The names are `DATASETS`; what each reads: docs/running.md, "Data" (your own ``.npz``:
`fedjax_sparse.data.arrays`). Files of the original releases (names: `KNOWN_MD5`) are verified against
their published MD5 checksums; ``verify_checksums=False`` accepts files that were legitimately re-packed. Every
problem a user can fix is raised as a `DataError` whose one-line message names the file and the fix.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import os
import pickle
import tarfile
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
from fedjax_sparse.errors import DataError, arg, in_cli
from fedjax_sparse.schema import Option, listing, resolve

__all__ = [
    "DATASETS",
    "DATASET_OPTIONS",
    "DEFAULT_DATA_DIR_ENV",
    "KNOWN_MD5",
    "NPZ_PREFIX",
    "Dataset",
    "dataset_options",
    "load_dataset",
    "read_idx",
]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """An in-memory dataset with a fixed train/test split.

    Attributes:
      name: dataset name as passed to `load_dataset`.
      train_x: ``uint8 [n, H, W, C]`` images (``C == 1`` for grayscale), or
        ``float32 [n, d]`` features for ``synthetic``.
      train_y: ``int32 [n]`` labels in ``0 .. num_classes - 1``.
      test_x, test_y: the same for the test split.
      num_classes: number of label values.
      train_client_ids, test_client_ids: ``int32 [n]`` owner client of each
        sample for naturally federated data (``synthetic``), else ``None``.
    """

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    train_client_ids: np.ndarray | None = None
    test_client_ids: np.ndarray | None = None

    def __post_init__(self):
        # Catch loader bugs here instead of as shape errors deep inside training.
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if len(x) != len(y):
                raise ValueError(f"{self.name}: {split}_x has {len(x)} rows but {split}_y has {len(y)}")
            ids = getattr(self, f"{split}_client_ids")
            if ids is not None and len(ids) != len(y):
                raise ValueError(f"{self.name}: {split}_client_ids has {len(ids)} rows but {split}_y has {len(y)}")
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                raise ValueError(
                    f"{self.name}: {split} labels span {y.min()}..{y.max()}, outside 0..{self.num_classes - 1}"
                )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example, e.g. ``(28, 28, 1)`` or ``(60,)``."""
        return tuple(self.train_x.shape[1:])

    def __repr__(self) -> str:  # the default repr would print the arrays
        fed = ", naturally federated" if self.train_client_ids is not None else ""
        return (
            f"Dataset({self.name!r}, train={self.train_x.shape} {self.train_x.dtype}, "
            f"test={self.test_x.shape}, num_classes={self.num_classes}{fed})"
        )


DATASETS: tuple[str, ...] = (
    "mnist",
    "fashion_mnist",
    "emnist_letters",
    "cifar10",
    "cifar100",
    "cifar10_sample",
    "svhn",
    "digits",
    "synthetic",
)

# Each data set's options (`load_dataset`'s keywords; RunConfig.dataset_options, --dataset-option KEY=VALUE),
# typed: a flag's or a config file's "false" is False, not bool("false").
_FILE_OPTIONS = {"verify_checksums": Option(bool, True, "check the files against their published MD5; false "
                                                         "accepts a re-packed copy")}
DATASET_OPTIONS: dict[str, dict[str, Option]] = {
    **{name: _FILE_OPTIONS for name in DATASETS if name not in ("digits", "synthetic")},
    "digits": {"test_fraction": Option(float, 0.2, "share of each class held out for testing"),
               "split_seed": Option(int, 0, "seed of the train/test split")},
    "synthetic": {"alpha": Option(float, 1.0, "spread of the clients' models"),
                  "beta": Option(float, 1.0, "spread of the clients' inputs"),
                  "num_clients": Option(int, 30, "clients generated; a run passes its --num-clients"),
                  "seed": Option(int, 0, "generator seed; a run passes its --seed"),
                  "iid": Option(bool, False, "one model and input mean for every client"),
                  "dimension": Option(int, 60, "features per example"),
                  "num_classes": Option(int, 10, "classes"),
                  "train_fraction": Option(float, 0.8, "share of each client's examples for training")},
}

# `load_dataset` name prefix for a user's .npz file: "npz:PATH" (see fedjax_sparse.data.arrays).
NPZ_PREFIX = "npz:"

# Used when `data_dir` is None (except for cifar10_sample, which has no default).
DEFAULT_DATA_DIR_ENV = "FEDJAX_SPARSE_DATA_DIR"
_DEFAULT_DATA_DIR = "data"

# Published MD5 checksums of the original release files, keyed by dataset and
# file name (the same name means different files in different datasets).
# Sources: yann.lecun.com (MNIST), zalandoresearch/fashion-mnist, the EMNIST
# gzip release, www.cs.toronto.edu/~kriz/cifar.html, ufldl.stanford.edu/housenumbers.
KNOWN_MD5: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "emnist_letters": {
        "emnist-letters-train-images-idx3-ubyte.gz": "8795078f199c478165fe18db82625747",
        "emnist-letters-train-labels-idx1-ubyte.gz": "c16de4f1848ddcdddd39ab65d2a7be52",
        "emnist-letters-test-images-idx3-ubyte.gz": "382093a19703f68edac6d01b8dfdfcad",
        "emnist-letters-test-labels-idx1-ubyte.gz": "d4108920cd86601ec7689a97f2de7f59",
    },
    "cifar10": {
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
    },
    "cifar100": {
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
    },
    "cifar10_sample": {
        "cifar10_train_first4000_lossless.npz": "b9ae1d7e3fd4fdb0705cf089c256519b",
        "cifar10_test_first1000_lossless.npz": "a6b8ebba25ef934a5871c86a5c74511a",
    },
    "svhn": {
        "train_32x32.mat": "e26dedcc434d2e4c54c9b2d4a06d8373",
        "test_32x32.mat": "eb5a983be6a315427106f1b164d9cef3",
    },
}

# Whose published file a checksum is: (dataset, file name).
_MD5_OWNER = {md5: (dataset, file) for dataset, files in KNOWN_MD5.items() for file, md5 in files.items()}

_TFDS_HINT = "install the tfds extra: pip install -e '.[tfds]'"


# --------------------------------------------------------------------------- helpers


def _check_md5(dataset: str, path: Path, raw: bytes, verify: bool, display: str | None = None) -> None:
    """Raise DataError if `path`'s name has a published checksum and `raw` does not match it."""
    if not verify:
        return
    expected = KNOWN_MD5.get(dataset, {}).get(path.name)
    if expected is None:
        return
    got = hashlib.md5(raw).hexdigest()
    if got != expected:
        owner = _MD5_OWNER.get(got)   # never (dataset, path.name): that checksum is `expected`
        if owner is not None:
            # Another original file (--data-dir at the wrong folder, or the wrong --dataset).
            other, other_file = owner
            raise DataError(
                f"{display or path}: these are {other}'s {other_file}: use {arg('dataset', other)}, "
                f"or point {arg('data_dir')} at {dataset}'s files"
            )
        raise DataError(
            f"{display or path}: checksum mismatch: expected {expected}, got {got}; "
            "re-download the original file (or, for a re-packed copy, "
            f"{arg('dataset_option', 'verify_checksums=false')}"
            + in_cli(', in a --config file "dataset_options": {"verify_checksums": false}') + ")"
        )


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({e.strerror or e}); check the path and permissions") from e


def _data_root(name: str, data_dir: str | os.PathLike | None, subdirs: tuple[str, ...],
               expected: str) -> tuple[Path, list[Path], str]:
    """The folder to search (`data_dir`, else ``$FEDJAX_SPARSE_DATA_DIR``, else ``./data``), the folders
    searched in it (itself and its conventional `subdirs`, e.g. ``data/mnist``), and the fix to name
    when the files (`expected`, in words) are not there; a DataError if the folder does not exist."""
    env = os.environ.get(DEFAULT_DATA_DIR_ENV)
    if data_dir is None and not env and name == "cifar10_sample":
        files = ", ".join(_CIFAR10_SAMPLE_FILES)
        raise DataError(
            f"cifar10_sample has no default location: pass {arg('data_dir')} pointing at the folder holding {files}"
        )
    root = Path(data_dir if data_dir is not None else env or _DEFAULT_DATA_DIR).expanduser()
    fix = f"pass {arg('data_dir')} pointing at a folder with these files"
    if data_dir is None:
        fix += f" (or set {DEFAULT_DATA_DIR_ENV})"
    fix += f", or use {arg('download')} ({_TFDS_HINT})"
    if not root.is_dir():
        raise DataError(f"{name}: data directory '{root}' not found ({expected}); {fix}")
    return root, [root] + [root / s for s in subdirs], fix


def _find_files(
    name: str,
    data_dir: str | os.PathLike | None,
    subdirs: tuple[str, ...],
    required: tuple[str, ...],
    variants: Callable[[str], tuple[str, ...]] = lambda r: (r,),
) -> dict[str, Path]:
    """Locate every `required` file (any accepted variant of its name) in one of the searched folders.

    Returns: required name -> existing path. Raises DataError naming the
    folder that holds the most of them, the expected files and the fix otherwise.
    """
    expected = ", ".join(required)
    root, dirs, fix = _data_root(name, data_dir, subdirs, f"expected files: {expected}")
    best: tuple[Path, dict[str, Path]] = (root, {})
    for d in dirs:
        found = {r: path for r in required
                 if (path := next((d / v for v in variants(r) if (d / v).is_file()), None)) is not None}
        if len(found) == len(required):
            return found
        if len(found) > len(best[1]):
            best = (d, found)
    d, found = best
    missing = ", ".join(r for r in required if r not in found)
    raise DataError(f"{name}: missing file(s) {missing} in '{d}' (expected files: {expected}); {fix}")


def dataset_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Every option of data set ``name`` (`DATASET_OPTIONS`; none for another name), ``options`` (texts or
    values) typed and the others at their defaults; a one-line DataError for an unknown key (listing the
    valid ones) or a value of another type."""
    schema = DATASET_OPTIONS.get(name, {})
    unknown = sorted(set(options) - set(schema))
    if unknown:
        raise DataError(f"{name}: unknown option(s) {', '.join(unknown)} ({arg('dataset_option', 'KEY=VALUE')}); "
                        "valid options: "
                        f"{listing(schema)}")
    try:
        given = resolve(schema, options, arg("dataset_option"), f"data set {name}")
    except ValueError as e:
        raise DataError(str(e)) from None
    return {**{key: option.default for key, option in schema.items()}, **given}


def _labels_int32(name: str, where: str, y: np.ndarray, num_classes: int, offset: int = 0) -> np.ndarray:
    y = np.asarray(y).reshape(-1).astype(np.int64) - offset
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DataError(
            f"{where}: labels span {y.min() + offset}..{y.max() + offset}, expected "
            f"{offset}..{num_classes - 1 + offset} for {name}; re-download the original file"
        )
    return y.astype(np.int32)


# --------------------------------------------------------------------------- IDX (MNIST family)

# IDX type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_idx(raw: bytes, display: str = "<bytes>") -> np.ndarray:
    """Parse (already decompressed) IDX bytes into an array in native byte order.

    Layout: 2 zero bytes, a type byte (see `_IDX_DTYPES`), a dimension count
    byte, that many big-endian uint32 sizes, then the row-major data. The data
    length must match the header exactly; anything else is reported as corrupt.
    """
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        got = " ".join(f"{b:02x}" for b in raw[:4])
        raise DataError(
            f"{display}: not an IDX file (magic bytes '{got}', expected '00 00 <type> <ndim>'); "
            "re-download the original file"
        )
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(f"{display}: truncated IDX header ({len(raw)} bytes); re-download the original file")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    got_bytes = len(raw) - header_len
    if got_bytes != expected:
        shape = "x".join(map(str, dims))
        raise DataError(
            f"{display}: truncated or corrupt IDX data: header says {shape} ({expected} bytes) "
            f"but the file holds {got_bytes}; re-download the original file"
        )
    arr = np.frombuffer(raw, dtype, offset=header_len).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=False)


def read_idx(path: str | os.PathLike, *, dataset: str | None = None, verify_checksums: bool = True) -> np.ndarray:
    """Read one IDX file (gzip-compressed if its name ends in ``.gz`` or it starts with the gzip magic).

    If `dataset` is given and the file name has a published checksum for it,
    the compressed bytes are checked against it after parsing (so that a
    truncated file is reported as truncated rather than as a checksum mismatch).
    """
    path = Path(path)
    raw = _read_bytes(path)
    data = raw
    if path.name.endswith(".gz") or raw[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            # OSError covers BadGzipFile; EOFError is a truncated stream.
            kind = "truncated gzip stream" if isinstance(e, EOFError) else f"not a valid gzip file ({e})"
            raise DataError(f"{path}: {kind}; re-download the original file") from e
    arr = parse_idx(data, str(path))
    if dataset is not None:
        _check_md5(dataset, path, raw, verify_checksums)
    return arr


def _idx_variants(base: str) -> tuple[str, ...]:
    # Standard gz name first; also the uncompressed file and the dotted spelling
    # ("train-images.idx3-ubyte") used by some mirrors.
    dotted = base.replace("-idx", ".idx")
    return (base + ".gz", base, dotted + ".gz", dotted)


_IDX_SPECS = {
    # name: (subdirs searched under data_dir, file prefix, num_classes, label offset, transpose)
    "mnist": (("mnist", "MNIST", "MNIST/raw"), "", 10, 0, False),
    "fashion_mnist": (("fashion_mnist", "fashion-mnist", "FashionMNIST", "FashionMNIST/raw"), "", 10, 0, False),
    "emnist_letters": (("emnist_letters", "emnist", "gzip", "EMNIST/raw"), "emnist-letters-", 26, 1, True),
}


def _load_idx_dataset(name: str, data_dir, verify_checksums: bool) -> Dataset:
    subdirs, prefix, num_classes, offset, transpose = _IDX_SPECS[name]
    test = "test" if prefix else "t10k"   # MNIST's release names its test files t10k-*
    bases = {"train_x": f"{prefix}train-images-idx3-ubyte", "train_y": f"{prefix}train-labels-idx1-ubyte",
             "test_x": f"{prefix}{test}-images-idx3-ubyte", "test_y": f"{prefix}{test}-labels-idx1-ubyte"}
    required = tuple(b + ".gz" for b in bases.values())
    found = _find_files(name, data_dir, subdirs, required, lambda r: _idx_variants(r[: -len(".gz")]))
    arrays = {}
    for key, base in bases.items():
        path = found[base + ".gz"]
        arr = read_idx(path, dataset=name, verify_checksums=verify_checksums)
        want_ndim = 3 if key.endswith("_x") else 1
        if arr.ndim != want_ndim or arr.dtype != np.uint8:
            raise DataError(
                f"{path}: expected a uint8 IDX array with {want_ndim} dims, got {arr.dtype} with shape "
                f"{arr.shape}; check that this is the {key.replace('_', ' ')} file of {name}"
            )
        arrays[key] = (path, arr)
    for split in ("train", "test"):
        (px, x), (py, y) = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if len(x) != len(y):
            raise DataError(f"{px}: {len(x)} images but {py.name} has {len(y)} labels; re-download both files")
    x_tr, x_te = arrays["train_x"][1], arrays["test_x"][1]
    if transpose:
        # EMNIST's IDX release stores every image transposed (column-major
        # relative to MNIST); swap H and W so letters are upright like MNIST digits.
        x_tr, x_te = x_tr.transpose(0, 2, 1), x_te.transpose(0, 2, 1)
    return Dataset(
        name=name,
        train_x=np.ascontiguousarray(x_tr)[..., None],
        train_y=_labels_int32(name, str(arrays["train_y"][0]), arrays["train_y"][1], num_classes, offset),
        test_x=np.ascontiguousarray(x_te)[..., None],
        test_y=_labels_int32(name, str(arrays["test_y"][0]), arrays["test_y"][1], num_classes, offset),
        num_classes=num_classes,
    )


# --------------------------------------------------------------------------- CIFAR pickles


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays/dtypes: a data file must not run arbitrary code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        if module == "numpy.core.multiarray":  # numpy>=2 moved it; avoid the deprecation shim
            module = "numpy._core.multiarray" if hasattr(np, "_core") else module
        return super().find_class(module, name)


def _unpickle_cifar(raw: bytes, display: str, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Decode one CIFAR batch: dict with ``data`` uint8 [n, 3072] (row-major C,H,W) and labels."""
    try:
        # encoding="bytes": the batches were pickled by Python 2, keys come back as bytes.
        d = _NumpyOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # any unpickling failure means a damaged or foreign file
        raise DataError(f"{display}: not a readable CIFAR python batch ({e}); re-download the original file") from e
    if not isinstance(d, dict):
        raise DataError(f"{display}: expected a pickled dict, got {type(d).__name__}; re-download the original file")
    d = {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}
    if "data" not in d or label_key not in d:
        raise DataError(
            f"{display}: missing key 'data' or '{label_key}' (has {sorted(d)}); is this the right CIFAR variant?"
        )
    data = np.asarray(d["data"])
    labels = np.asarray(d[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise DataError(
            f"{display}: expected uint8 data [n, 3072] and n labels, got {data.dtype} {data.shape} and "
            f"{len(labels)} labels; re-download the original file"
        )
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # CHW -> HWC
    return np.ascontiguousarray(images), labels


_CIFAR_SPECS = {
    # name: (folder in the archive, archive name, train files, test files, label key, classes, subdirs)
    "cifar10": (
        "cifar-10-batches-py",
        "cifar-10-python.tar.gz",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        "labels",
        10,
        ("cifar10", "cifar-10"),
    ),
    "cifar100": (
        "cifar-100-python",
        "cifar-100-python.tar.gz",
        ("train",),
        ("test",),
        "fine_labels",
        100,
        ("cifar100", "cifar-100"),
    ),
}


def _load_cifar(name: str, data_dir, verify_checksums: bool) -> Dataset:
    folder, archive, train_files, test_files, label_key, num_classes, subdirs = _CIFAR_SPECS[name]
    required = train_files + test_files
    expected = f"{folder}/{{{','.join(required)}}} or {archive}"
    root, bases, fix = _data_root(name, data_dir, subdirs, f"expected {expected}")
    # Extracted batches win over an archive: they are what users usually keep.
    extracted = next((d for base in bases for d in (base, base / folder) if all((d / f).is_file() for f in required)),
                     None)
    if extracted is not None:
        blobs = {f: (_read_bytes(extracted / f), str(extracted / f)) for f in required}
    else:
        tar = next((base / archive for base in bases if (base / archive).is_file()), None)
        if tar is None:
            raise DataError(f"{name}: no CIFAR files in '{root}' (expected {expected}); {fix}")
        blobs = _read_tar_members(tar, required)

    def read(f: str) -> tuple[np.ndarray, np.ndarray]:
        raw, display = blobs[f]
        _check_md5(name, Path(f), raw, verify_checksums, display)
        x, y = _unpickle_cifar(raw, display, label_key)
        return x, _labels_int32(name, display, y, num_classes)

    return _from_files(name, num_classes, train_files, test_files, read)


def _from_files(name: str, num_classes: int, train_files: tuple[str, ...], test_files: tuple[str, ...],
                read: Callable[[str], tuple[np.ndarray, np.ndarray]]) -> Dataset:
    """The Dataset whose splits are their files' ``read(file) -> (x, int32 labels)``, concatenated in order."""
    (x_tr, y_tr), (x_te, y_te) = ([np.concatenate(a) for a in zip(*map(read, files))]
                                  for files in (train_files, test_files))
    return Dataset(name, x_tr, y_tr, x_te, y_te, num_classes=num_classes)


def _read_tar_members(archive: Path, required: tuple[str, ...]) -> dict[str, tuple[bytes, str]]:
    """Read the members whose base names are `required`, in memory (nothing is extracted to disk)."""
    out: dict[str, tuple[bytes, str]] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                base = member.name.rsplit("/", 1)[-1]
                if member.isfile() and base in required and base not in out:
                    fh = tar.extractfile(member)
                    assert fh is not None
                    out[base] = (fh.read(), f"{archive}:{member.name}")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise DataError(f"{archive}: damaged or truncated archive ({e}); re-download the original file") from e
    missing = [r for r in required if r not in out]
    if missing:
        raise DataError(f"{archive}: archive lacks {', '.join(missing)}; re-download the original file")
    return out


# --------------------------------------------------------------------------- other file formats

_CIFAR10_SAMPLE_FILES = ("cifar10_train_first4000_lossless.npz", "cifar10_test_first1000_lossless.npz")


def _load_cifar10_sample(name: str, data_dir, verify_checksums: bool) -> Dataset:
    found = _find_files(name, data_dir, ("cifar10_sample",), _CIFAR10_SAMPLE_FILES)

    def read(f: str) -> tuple[np.ndarray, np.ndarray]:
        path = found[f]
        raw = _read_bytes(path)
        try:
            with np.load(io.BytesIO(raw), allow_pickle=False) as z:
                x, y = z["x"], z["y"]
        except Exception as e:  # zip/npy errors come in many types
            raise DataError(f"{path}: not a readable npz with arrays 'x' and 'y' ({e}); re-copy the file") from e
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (32, 32, 3) or len(x) != len(y):
            raise DataError(f"{path}: expected x uint8 [n,32,32,3] and n labels, got {x.dtype} {x.shape}; "
                            "re-copy the file")
        _check_md5(name, path, raw, verify_checksums)
        return x, _labels_int32(name, str(path), y, 10)

    return _from_files(name, 10, _CIFAR10_SAMPLE_FILES[:1], _CIFAR10_SAMPLE_FILES[1:], read)


def _load_svhn(name: str, data_dir, verify_checksums: bool) -> Dataset:
    files = ("train_32x32.mat", "test_32x32.mat")
    found = _find_files(name, data_dir, ("svhn", "SVHN", "svhn_cropped"), files)
    try:
        import scipy.io  # only SVHN needs scipy, so it is not a core dependency
    except ImportError as e:
        raise DataError("svhn: reading .mat files needs scipy: pip install scipy") from e

    def read(f: str) -> tuple[np.ndarray, np.ndarray]:
        path = found[f]
        raw = _read_bytes(path)
        try:
            mat = scipy.io.loadmat(io.BytesIO(raw))
            x, y = mat["X"], mat["y"]
        except Exception as e:  # scipy raises assorted errors for damaged files
            raise DataError(f"{path}: not a readable SVHN .mat file with 'X' and 'y' ({e}); re-download it") from e
        if x.ndim != 4 or x.shape[:3] != (32, 32, 3) or x.shape[3] != y.size:
            raise DataError(f"{path}: expected X [32,32,3,n] and n labels, got X {x.shape}, y {y.shape}; "
                            "re-download it")
        _check_md5(name, path, raw, verify_checksums)
        y = np.asarray(y).reshape(-1).astype(np.int64)
        y[y == 10] = 0  # SVHN labels digit 0 as 10
        images = np.ascontiguousarray(x.transpose(3, 0, 1, 2)).astype(np.uint8, copy=False)
        return images, _labels_int32(name, str(path), y, 10)

    return _from_files(name, 10, files[:1], files[1:], read)


# --------------------------------------------------------------------------- generated / embedded


def _load_digits(test_fraction: float, split_seed: int) -> Dataset:
    """scikit-learn's 1797 8x8 digits as uint8 [n, 8, 8, 1] (0..16 scaled by 255//16), stratified split.

    The split uses our own numpy Generator (not sklearn's splitter) so it stays
    identical across scikit-learn versions.
    """
    from sklearn.datasets import load_digits

    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"digits: test_fraction must be in (0, 1), got {test_fraction}")
    bunch = load_digits()
    images = (bunch.images.astype(np.int64) * 255 // 16).astype(np.uint8)[..., None]
    labels = bunch.target.astype(np.int32)
    rng = np.random.default_rng(split_seed)
    is_test = np.zeros(len(labels), bool)
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(labels == c))
        is_test[idx[: int(round(test_fraction * len(idx)))]] = True
    return Dataset(
        "digits", images[~is_test], labels[~is_test], images[is_test], labels[is_test], num_classes=10
    )


def _load_synthetic(alpha: float, beta: float, num_clients: int, seed: int, iid: bool, dimension: int,
                    num_classes: int, train_fraction: float) -> Dataset:
    """FedProx Synthetic(alpha, beta) (Li et al., MLSys 2020, ``generate_synthetic``).

    Client k has ``lognormal(4, 2) + 50`` samples (integer part); its model is
    ``W_k ~ N(u_k, 1)^{d x C}``, ``b_k ~ N(u_k, 1)^C`` with ``u_k ~ N(0, alpha)``
    and its inputs ``x ~ N(v_k, Sigma)`` with ``v_k ~ N(B_k, 1)^d``,
    ``B_k ~ N(0, beta)``, ``Sigma = diag(j^-1.2)``; the label is
    ``argmax(x W_k + b_k)``. ``iid=True`` shares one ``(W, b)`` and uses
    ``v_k = B_k`` as in the reference. Randomness comes from
    ``numpy.random.default_rng(seed)`` (so values differ from the reference's
    global-state draws, but the distribution is the same). Each client's samples
    are shuffled and split ``train_fraction`` / rest (the reference used 0.9).
    """
    if num_clients < 1 or dimension < 1 or num_classes < 2:
        raise DataError("synthetic: need num_clients >= 1, dimension >= 1, num_classes >= 2")
    if alpha < 0 or beta < 0:
        raise DataError(f"synthetic: alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    if not 0.0 < train_fraction < 1.0:
        raise DataError(f"synthetic: train_fraction must be in (0, 1), got {train_fraction}")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    mean_w = rng.normal(0, alpha, num_clients)   # also the mean of b (u_k)
    big_b = rng.normal(0, beta, num_clients)
    std_x = np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2) ** 0.5
    if iid:
        mean_x = np.ones((num_clients, dimension)) * big_b[:, None]
        w_global = rng.normal(0, 1, (dimension, num_classes))
        b_global = rng.normal(0, 1, num_classes)
    else:
        mean_x = rng.normal(big_b[:, None], 1, (num_clients, dimension))
    train: list[tuple] = []
    test: list[tuple] = []
    for k in range(num_clients):
        if iid:
            w, b = w_global, b_global
        else:
            w = rng.normal(mean_w[k], 1, (dimension, num_classes))
            b = rng.normal(mean_w[k], 1, num_classes)
        # Diagonal covariance: scaling standard normals equals multivariate_normal, far cheaper.
        x = mean_x[k] + rng.standard_normal((sizes[k], dimension)) * std_x
        y = np.argmax(x @ w + b, axis=1)  # softmax is monotone, argmax of logits suffices
        perm = rng.permutation(sizes[k])
        n_train = int(train_fraction * sizes[k])
        for split, idx in ((train, perm[:n_train]), (test, perm[n_train:])):
            split.append((x[idx].astype(np.float32), y[idx].astype(np.int32), np.full(len(idx), k, np.int32)))
    (x_tr, y_tr, ids_tr), (x_te, y_te, ids_te) = ([np.concatenate(a) for a in zip(*split)] for split in (train, test))
    return Dataset("synthetic", x_tr, y_tr, x_te, y_te, num_classes, train_client_ids=ids_tr, test_client_ids=ids_te)


# --------------------------------------------------------------------------- TFDS

_TFDS_NAMES = {
    "mnist": ("mnist", 10, 0, False),
    "fashion_mnist": ("fashion_mnist", 10, 0, False),
    "emnist_letters": ("emnist/letters", 26, 1, True),
    "cifar10": ("cifar10", 10, 0, False),
    "cifar100": ("cifar100", 100, 0, False),  # tfds "label" is the fine label
    "svhn": ("svhn_cropped", 10, 0, False),
}


def _load_tfds(name: str, data_dir) -> Dataset:
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataError(f"{name}: {arg('download')} needs tensorflow_datasets; {_TFDS_HINT}") from e
    tfds_name, num_classes, offset, transpose = _TFDS_NAMES[name]
    try:
        splits = tfds.as_numpy(
            tfds.load(
                tfds_name,
                split=["train", "test"],
                batch_size=-1,
                as_supervised=True,
                data_dir=None if data_dir is None else str(data_dir),
                download=True,
            )
        )
    except Exception as e:  # network, quota and builder errors all end here
        raise DataError(
            f"{name}: tfds could not load '{tfds_name}' ({type(e).__name__}: {e}); "
            f"check the network connection or pass {arg('data_dir')} with the original files"
        ) from e
    arrays = []
    for x, y in splits:
        x = np.asarray(x, np.uint8)
        if transpose:  # TFDS keeps EMNIST's transposed storage (tensorflow/datasets#812)
            x = x.transpose(0, 2, 1, 3)
        arrays.append((np.ascontiguousarray(x), _labels_int32(name, f"tfds:{tfds_name}", y, num_classes, offset)))
    (x_tr, y_tr), (x_te, y_te) = arrays
    return Dataset(name, x_tr, y_tr, x_te, y_te, num_classes=num_classes)


# --------------------------------------------------------------------------- entry point


def load_dataset(name: str, data_dir: str | os.PathLike | None = None, *, download: bool = False, **options) -> Dataset:
    """Load dataset `name` (one of `DATASETS`) into memory.

    Args:
      name: dataset name.
      data_dir: folder holding the original files, or a parent folder with a
        conventionally named subfolder (``data/mnist``, ``data/cifar-10-batches-py``
        ...). Defaults to ``$FEDJAX_SPARSE_DATA_DIR`` or ``./data``;
        ``cifar10_sample`` has no default. Ignored by ``digits`` and
        ``synthetic``; with ``download=True`` it is TFDS's cache folder.
      download: fetch through tensorflow_datasets instead of reading local
        files (needs the ``tfds`` extra and network access).
      **options: the data set's options, as `DATASET_OPTIONS` declares them (type, default, what;
        ``python -m fedjax_sparse list`` shows them): ``verify_checksums`` for the file-based ones,
        ``test_fraction``, ``split_seed`` for ``digits``, the generator's for ``synthetic``; text is
        read as the declared type.

    Your own ``.npz`` files are read by `fedjax_sparse.data.load` (``"npz:PATH"``).

    Raises:
      DataError: unknown name or option, missing/corrupt/mismatching files.
    """
    if isinstance(name, str) and name.startswith(NPZ_PREFIX):
        raise DataError(f"load_dataset loads the built-in data sets; read '{name}' with "
                        "fedjax_sparse.data.load (or load_npz)")
    if name not in DATASETS:
        raise DataError(
            f"unknown dataset '{name}'; valid names: {', '.join(DATASETS)}, or npz:PATH for your own .npz file"
        )
    options = dataset_options(name, options)
    if name == "digits":
        return _load_digits(**options)
    if name == "synthetic":
        return _load_synthetic(**options)
    if download:
        if name not in _TFDS_NAMES:
            raise DataError(f"{name}: cannot be downloaded; pass {arg('data_dir')} (use cifar10 for the full set)")
        return _load_tfds(name, data_dir)
    loaders = {**dict.fromkeys(_IDX_SPECS, _load_idx_dataset), **dict.fromkeys(_CIFAR_SPECS, _load_cifar),
               "cifar10_sample": _load_cifar10_sample, "svhn": _load_svhn}
    return loaders[name](name, data_dir, options["verify_checksums"])
