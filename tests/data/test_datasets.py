"""Tests for fedjax_sparse.data.datasets.

Real-data tests read ../shared/data (skipped when absent); format tests write
tiny files in the original formats into tmp_path.
"""

import gzip
import pathlib
import pickle
import struct
import sys
import tarfile

import numpy as np
import pytest

from fedjax_sparse.data import datasets as ds
from fedjax_sparse.data.datasets import load_dataset
from fedjax_sparse.errors import DataError

SHARED_DATA = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data"


def shared(name: str) -> pathlib.Path:
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"real dataset folder {path} not available")
    return path


# --------------------------------------------------------------------------- real IDX data


def test_fashion_mnist_real():
    d = load_dataset("fashion_mnist", shared("fashion_mnist"))
    assert d.train_x.shape == (60000, 28, 28, 1) and d.train_x.dtype == np.uint8
    assert d.test_x.shape == (10000, 28, 28, 1)
    assert d.train_y.dtype == np.int32 and d.train_y.shape == (60000,)
    assert d.train_y[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert d.train_y.min() == 0 and d.train_y.max() == 9 and d.num_classes == 10
    assert d.input_shape == (28, 28, 1)
    assert d.train_client_ids is None


def test_mnist_real_via_parent_dir():
    # --data-dir may point at the parent folder holding mnist/.
    d = load_dataset("mnist", shared("mnist").parent)
    assert d.train_x.shape == (60000, 28, 28, 1) and d.test_y.shape == (10000,)
    assert d.train_y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert set(np.unique(d.test_y).tolist()) == set(range(10))


def test_emnist_letters_real_labels_and_orientation():
    root = shared("emnist_letters")
    d = load_dataset("emnist_letters", root)
    assert d.train_x.shape == (124800, 28, 28, 1) and d.test_x.shape == (20800, 28, 28, 1)
    assert d.num_classes == 26 and d.train_y.min() == 0 and d.train_y.max() == 25
    raw_labels = ds.read_idx(root / "emnist-letters-train-labels-idx1-ubyte.gz")
    np.testing.assert_array_equal(d.train_y, raw_labels.astype(np.int32) - 1)
    raw = ds.read_idx(root / "emnist-letters-test-images-idx3-ubyte.gz")
    np.testing.assert_array_equal(d.test_x[:5, :, :, 0], raw[:5].transpose(0, 2, 1))


def test_cifar10_sample_real():
    d = load_dataset("cifar10_sample", shared("cifar10_sample"))
    assert d.train_x.shape == (4000, 32, 32, 3) and d.test_x.shape == (1000, 32, 32, 3)
    assert d.train_y[:10].tolist() == [6, 9, 9, 4, 1, 1, 2, 7, 8, 3]
    assert d.test_y[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]


def test_cifar10_sample_needs_data_dir(monkeypatch):
    monkeypatch.delenv(ds.DEFAULT_DATA_DIR_ENV, raising=False)
    with pytest.raises(DataError, match="--data-dir"):
        load_dataset("cifar10_sample")


# --------------------------------------------------------------------------- IDX format and validation


def idx_bytes(arr: np.ndarray) -> bytes:
    assert arr.dtype == np.uint8
    return struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


MNIST_NAMES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def write_fake_mnist(folder: pathlib.Path, compress: bool = True):
    rng = np.random.default_rng(0)
    arrays = {
        "train_x": rng.integers(0, 256, (6, 28, 28), dtype=np.uint8),
        "train_y": np.array([0, 1, 2, 3, 4, 9], np.uint8),
        "test_x": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        "test_y": np.array([5, 6, 7], np.uint8),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for key, base in MNIST_NAMES.items():
        data = idx_bytes(arrays[key])
        if compress:
            (folder / (base + ".gz")).write_bytes(gzip.compress(data))
        else:
            (folder / base).write_bytes(data)
    return arrays


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.fast
def test_idx_round_trip_gz_and_uncompressed(tmp_path, compress):
    arrays = write_fake_mnist(tmp_path, compress)
    d = load_dataset("mnist", tmp_path, verify_checksums=False)
    np.testing.assert_array_equal(d.train_x[..., 0], arrays["train_x"])
    np.testing.assert_array_equal(d.test_y, arrays["test_y"])
    assert d.train_y.dtype == np.int32


def test_checksum_mismatch_detected(tmp_path):
    write_fake_mnist(tmp_path)  # valid IDX, standard names, other content
    with pytest.raises(DataError, match="checksum mismatch") as err:
        load_dataset("mnist", tmp_path)
    msg = str(err.value)
    assert "train-images-idx3-ubyte.gz" in msg and "f68b3c2dcbeaaa9fbdd348bbdeb94873" in msg
    assert "re-download" in msg and "verify_checksums" in msg and "--config" in msg and "\n" not in msg


def test_idx_size_mismatch_names_file(tmp_path):
    write_fake_mnist(tmp_path)
    bad = idx_bytes(np.zeros((10, 28, 28), np.uint8))[:-28 * 28 * 5]  # header says 10 images, holds 5
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(bad))
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz.*truncated or corrupt IDX data"):
        load_dataset("mnist", tmp_path, verify_checksums=False)


def test_truncated_gzip_names_file(tmp_path):
    write_fake_mnist(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte.gz: truncated gzip stream"):
        load_dataset("mnist", tmp_path, verify_checksums=False)


def test_bad_magic_names_file(tmp_path):
    write_fake_mnist(tmp_path, compress=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x12\x34\x08\x01" + b"\x00" * 20)
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.*not an IDX file"):
        load_dataset("mnist", tmp_path)


def test_idx_label_count_mismatch(tmp_path):
    write_fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros(2, np.uint8))))
    with pytest.raises(DataError, match="3 images but t10k-labels-idx1-ubyte.gz has 2 labels"):
        load_dataset("mnist", tmp_path, verify_checksums=False)


def test_missing_dir_lists_expected_files(tmp_path):
    with pytest.raises(DataError) as err:
        load_dataset("fashion_mnist", tmp_path / "nope")
    msg = str(err.value)
    assert "nope" in msg and "not found" in msg
    for base in MNIST_NAMES.values():
        assert base + ".gz" in msg
    assert "--data-dir" in msg and "--download" in msg and "\n" not in msg


def test_missing_file_named(tmp_path):
    write_fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="missing file\\(s\\) t10k-labels-idx1-ubyte.gz"):
        load_dataset("mnist", tmp_path)


def test_unknown_name_and_option():
    with pytest.raises(DataError, match="valid names: mnist, fashion_mnist"):
        load_dataset("imagenet")
    with pytest.raises(DataError, match="unknown option"):
        load_dataset("digits", bogus=1)


def test_data_set_options_are_typed_wherever_they_come_from():
    """``bool("false")`` was True: a config file's or a flag's ``"false"`` gave iid data."""
    plain = load_dataset("synthetic", num_clients=3, iid=False)
    as_text = load_dataset("synthetic", num_clients="3", iid="false")
    np.testing.assert_array_equal(plain.train_x, as_text.train_x)
    with pytest.raises(DataError, match=r"--dataset-option test_fraction='half' of data set digits: expected a "
                                        r"number"):
        load_dataset("digits", test_fraction="half")
    with pytest.raises(DataError, match=r"unknown option\(s\) bogus .*valid options: test_fraction=0.2, split_seed=0"):
        load_dataset("digits", bogus=1)


def test_download_without_tfds_gives_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail
    with pytest.raises(DataError, match=r"pip install -e '\.\[tfds\]'"):
        load_dataset("mnist", tmp_path, download=True)


# --------------------------------------------------------------------------- CIFAR pickles


def cifar_batch(n: int, label_key: bytes, seed: int, num_classes: int) -> tuple[bytes, np.ndarray, list]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = rng.integers(0, num_classes, n).tolist()
    d = {b"batch_label": b"fake", label_key: labels, b"data": data, b"filenames": [b"x.png"] * n}
    if label_key == b"fine_labels":
        d[b"coarse_labels"] = [0] * n
    return pickle.dumps(d, protocol=2), data, labels


def write_cifar10(folder: pathlib.Path):
    folder.mkdir(parents=True, exist_ok=True)
    contents = {}
    for i, name in enumerate([f"data_batch_{j}" for j in range(1, 6)] + ["test_batch"]):
        raw, data, labels = cifar_batch(3, b"labels", i, 10)
        (folder / name).write_bytes(raw)
        contents[name] = (data, labels)
    return contents


@pytest.mark.fast
def test_cifar10_pickles_hwc(tmp_path):
    contents = write_cifar10(tmp_path / "cifar-10-batches-py")
    d = load_dataset("cifar10", tmp_path, verify_checksums=False)
    assert d.train_x.shape == (15, 32, 32, 3) and d.test_x.shape == (3, 32, 32, 3)
    assert d.train_x.dtype == np.uint8 and d.num_classes == 10
    data, labels = contents["data_batch_1"]
    # Row-major CHW: channel c, row h, column w sits at c*1024 + h*32 + w.
    c, h, w = 2, 5, 17
    assert d.train_x[1, h, w, c] == data[1, c * 1024 + h * 32 + w]
    np.testing.assert_array_equal(d.train_x[0], data[0].reshape(3, 32, 32).transpose(1, 2, 0))
    assert d.train_y[:3].tolist() == labels
    assert d.train_y[12:15].tolist() == contents["data_batch_5"][1]
    assert d.test_y.tolist() == contents["test_batch"][1]


def test_cifar10_tar_gz_and_checksums(tmp_path):
    src = tmp_path / "src"
    contents = write_cifar10(src / "cifar-10-batches-py")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with tarfile.open(data_dir / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(src / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    d = load_dataset("cifar10", data_dir, verify_checksums=False)
    np.testing.assert_array_equal(d.test_x[2], contents["test_batch"][0][2].reshape(3, 32, 32).transpose(1, 2, 0))
    # The fake batches carry the original names, so the default check must reject them.
    with pytest.raises(DataError, match="data_batch_1: checksum mismatch: expected c99cafc1"):
        load_dataset("cifar10", data_dir)


def test_cifar100_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    train, _, train_labels = cifar_batch(4, b"fine_labels", 0, 100)
    test, test_data, _ = cifar_batch(2, b"fine_labels", 1, 100)
    (folder / "train").write_bytes(train)
    (folder / "test").write_bytes(test)
    d = load_dataset("cifar100", folder, verify_checksums=False)
    assert d.num_classes == 100 and d.train_y.tolist() == train_labels
    assert d.test_x[1, 31, 0, 1] == test_data[1, 1024 + 31 * 32 + 0]


def test_cifar_refuses_code_in_pickle(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    write_cifar10(folder)
    (folder / "test_batch").write_bytes(pickle.dumps({"data": pathlib.Path("x")}))
    with pytest.raises(DataError, match="test_batch: not a readable CIFAR python batch"):
        load_dataset("cifar10", tmp_path, verify_checksums=False)


def test_cifar_missing_files(tmp_path):
    with pytest.raises(DataError, match="cifar-10-batches-py.*cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path)


# --------------------------------------------------------------------------- SVHN


def test_svhn_mat_labels_and_axes(tmp_path):
    scipy_io = pytest.importorskip("scipy.io")
    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("test", 2)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = np.array([[10], [1], [9], [10]][:n], np.uint8)
        scipy_io.savemat(tmp_path / f"{split}_32x32.mat", {"X": x, "y": y})
        if split == "train":
            train_x = x
    d = load_dataset("svhn", tmp_path, verify_checksums=False)
    assert d.train_x.shape == (4, 32, 32, 3) and d.test_x.shape == (2, 32, 32, 3)
    assert d.train_y.tolist() == [0, 1, 9, 0] and d.test_y.tolist() == [0, 1]
    np.testing.assert_array_equal(d.train_x[2], train_x[:, :, :, 2])
    with pytest.raises(DataError, match="train_32x32.mat: checksum mismatch"):
        load_dataset("svhn", tmp_path)


# --------------------------------------------------------------------------- digits and synthetic


@pytest.mark.fast
def test_digits():
    a = load_dataset("digits")
    b = load_dataset("digits")
    assert len(a.train_x) + len(a.test_x) == 1797
    assert a.train_x.shape[1:] == (8, 8, 1) and a.train_x.dtype == np.uint8
    assert a.train_x.max() == 255 and 0.15 < len(a.test_x) / 1797 < 0.25
    np.testing.assert_array_equal(a.train_x, b.train_x)
    np.testing.assert_array_equal(a.test_y, b.test_y)
    assert set(np.unique(a.test_y).tolist()) == set(range(10))  # stratified


@pytest.mark.fast
def test_synthetic_deterministic_and_federated():
    a = load_dataset("synthetic", seed=0)
    b = load_dataset("synthetic", seed=0)
    c = load_dataset("synthetic", seed=1)
    np.testing.assert_array_equal(a.train_x, b.train_x)
    np.testing.assert_array_equal(a.test_y, b.test_y)
    assert a.train_x.shape != c.train_x.shape or not np.array_equal(a.train_x, c.train_x)
    assert a.train_x.dtype == np.float32 and a.train_x.shape[1] == 60 and a.num_classes == 10
    assert a.train_y.dtype == np.int32 and a.train_y.max() <= 9
    assert np.unique(a.train_client_ids).tolist() == list(range(30))
    assert np.unique(a.test_client_ids).tolist() == list(range(30))
    per_client = np.bincount(a.train_client_ids) + np.bincount(a.test_client_ids)
    assert per_client.min() >= 50  # lognormal + 50 samples each
    frac = np.bincount(a.train_client_ids) / per_client
    assert np.all((frac > 0.75) & (frac <= 0.8))
    small = load_dataset("synthetic", num_clients=5, alpha=0.0, beta=0.0, iid=True)
    assert np.unique(small.train_client_ids).size == 5
