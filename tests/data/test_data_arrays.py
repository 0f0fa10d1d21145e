"""Tests for fedjax_sparse.data.arrays: your own arrays / .npz files -> PartitionedData.

The equivalence tests run on a Fashion-MNIST subset from ../shared/data (skipped when absent);
the rest use tiny hand-made arrays whose client membership is known by construction.
"""

import dataclasses
import json

import numpy as np
import pytest

from fedjax_sparse.cli import main
from fedjax_sparse.data import (
    DataError,
    PartitionedData,
    build_federated_data,
    from_arrays,
    load,
    load_dataset,
    load_npz,
    partition_dataset,
)
from fedjax_sparse.data.arrays import partition

# --------------------------------------------------------------------------- helpers


def assert_federated_equal(a, b):
    for f in dataclasses.fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if f.metadata.get("pytree_node", True):
            np.testing.assert_array_equal(np.asarray(va), np.asarray(vb), err_msg=f.name)
            assert np.asarray(va).dtype == np.asarray(vb).dtype, f.name
        else:
            assert va == vb, f.name


def ids_from(part):
    """Per-example client id of every train / test example (each example owned exactly once)."""
    ids = []
    for indices in (part.train_indices, part.test_indices):
        n = sum(len(i) for i in indices)
        out = np.full(n, -1, np.int64)
        for k, idx in enumerate(indices):
            out[idx] = k
        assert (out >= 0).all()
        ids.append(out)
    return ids


@pytest.fixture(scope="module")
def fmnist(shared_data):
    d = load_dataset("fashion_mnist", shared_data / "fashion_mnist")
    return dataclasses.replace(d, train_x=d.train_x[:3000], train_y=d.train_y[:3000],
                               test_x=d.test_x[:1000], test_y=d.test_y[:1000])


def small(**overrides):
    """6 train / 3 test 4x4 uint8 images, 3 classes."""
    rng = np.random.default_rng(0)
    args = dict(x_train=rng.integers(0, 256, (6, 4, 4), dtype=np.uint8), y_train=np.array([0, 1, 2, 0, 1, 2]),
                x_test=rng.integers(0, 256, (3, 4, 4), dtype=np.uint8), y_test=np.array([2, 1, 0]))
    args.update(overrides)
    return args


# --------------------------------------------------------------------------- equivalence with the built-in path


@pytest.mark.fast
def test_client_ids_reproduce_a_builtin_partition(fmnist):
    part = partition_dataset(fmnist, "dirichlet:0.5", 10, seed=3)
    ids_train, ids_test = ids_from(part)
    pdata = from_arrays(fmnist.train_x, fmnist.train_y, fmnist.test_x, fmnist.test_y, ids_train, ids_test)
    assert pdata.num_clients == 10 and pdata.client_names == tuple(range(10))
    assert pdata.partition.spec == "natural" and pdata.num_classes == 10 and pdata.input_shape == (28, 28, 1)
    for mine, ref in zip(pdata.partition.train_indices + pdata.partition.test_indices,
                         part.train_indices + part.test_indices):
        np.testing.assert_array_equal(mine, ref)
    assert_federated_equal(pdata.to_federated(), build_federated_data(fmnist, part))


def test_spec_without_ids_matches_the_builtin_path(fmnist):
    pdata = from_arrays(fmnist.train_x, fmnist.train_y, fmnist.test_x, fmnist.test_y,
                        partition="dirichlet:0.5", num_clients=10, seed=3)
    part = partition_dataset(fmnist, "dirichlet:0.5", 10, seed=3)
    assert pdata.client_names == () and pdata.partition.spec == "dirichlet:0.5"
    assert_federated_equal(pdata.to_federated(), build_federated_data(fmnist, part))
    assert_federated_equal(pdata.to_federated("standardize"),
                           build_federated_data(fmnist, part, preprocess="standardize"))
    # The digest covers content, not the name: the built-in dataset partitioned the same way agrees.
    assert partition(fmnist, "dirichlet:0.5", 10, seed=3).digest() == pdata.digest()
    assert partition(fmnist, "dirichlet:0.5", 10, seed=4).digest() != pdata.digest()


# --------------------------------------------------------------------------- client ids


def test_integer_client_ids_map_to_sorted_order():
    a = small()
    pdata = from_arrays(**a, train_client_ids=[42, 7, 42, 1000, 7, 42], test_client_ids=[1000, 7, 7])
    assert pdata.client_names == (7, 42, 1000)
    assert all(type(n) is int for n in pdata.client_names)
    assert [t.tolist() for t in pdata.partition.train_indices] == [[1, 4], [0, 2, 5], [3]]
    assert [t.tolist() for t in pdata.partition.test_indices] == [[1, 2], [], [0]]  # client 42 has no test
    fed = pdata.to_federated()
    assert fed.train_count.tolist() == [2, 3, 1] and fed.test_count.tolist() == [2, 0, 1]
    assert np.asarray(fed.train_idx)[1].tolist() == [0, 2, 5]
    assert fed.input_shape == (4, 4, 1) == pdata.input_shape  # channel added to [n, H, W]
    np.testing.assert_array_equal(np.asarray(fed.train_x)[3, :, :, 0], a["x_train"][3])
    assert pdata.describe()["client_names"] == [7, 42, 1000]


def test_string_client_ids_and_numpy_id_arrays():
    pdata = from_arrays(**small(), train_client_ids=np.array(["bob", "alice", "bob", "carol", "alice", "bob"]),
                        test_client_ids=["carol", "carol", "alice"], min_client_samples=1)
    assert pdata.client_names == ("alice", "bob", "carol")
    assert [t.tolist() for t in pdata.partition.train_indices] == [[1, 4], [0, 2, 5], [3]]
    assert [t.tolist() for t in pdata.partition.test_indices] == [[2], [], [0, 1]]
    # num_clients / partition may be given when consistent with the ids.
    again = from_arrays(**small(), train_client_ids=[3, 1, 3, 2, 1, 3], test_client_ids=[2, 1, 1],
                        partition="natural", num_clients=3)
    assert again.client_names == (1, 2, 3) and again.num_clients == 3


def test_feature_and_float_inputs():
    rng = np.random.default_rng(1)
    pdata = from_arrays(rng.normal(size=(40, 5)), rng.integers(0, 4, 40, dtype=np.uint8),
                        rng.normal(size=(10, 5)), rng.integers(0, 4, 10, dtype=np.int16),
                        partition="iid", num_clients=4, num_classes=6)
    assert pdata.dataset.train_x.dtype == np.float32 and pdata.dataset.train_y.dtype == np.int32
    assert pdata.num_classes == 6 and pdata.input_shape == (5,)
    fed = pdata.to_federated()
    assert fed.input_shape == (5,) and fed.num_clients == 4 and int(fed.train_count.sum()) == 40
    np.testing.assert_allclose(np.asarray(fed.preprocess(fed.train_x)), pdata.dataset.train_x)  # floats as given
    nhwc = from_arrays(**small(x_train=np.zeros((6, 4, 4, 3), np.uint8), x_test=np.zeros((3, 4, 4, 3), np.uint8)),
                       partition="iid", num_clients=2)
    assert nhwc.input_shape == (4, 4, 3) == nhwc.to_federated().input_shape


# --------------------------------------------------------------------------- bad input


def _ids(**kw):
    return dict(train_client_ids=[1, 1, 2, 2, 3, 3], test_client_ids=[1, 2, 3], **kw)


def _spec(**kw):
    return dict(partition="iid", num_clients=2, **kw)


BAD = [
    # (overrides of small(), other kwargs, expected message)
    ("x_y_length", dict(y_train=np.array([0, 1, 2, 0, 1])), _spec(), r"x_train has 6 examples but y_train has 5 labels"),
    ("ids_y_length", {}, dict(train_client_ids=[1, 1, 2, 2, 3], test_client_ids=[1, 2, 3]),
     r"train_client_ids has 5 entries but y_train has 6; pass one client id per example"),
    ("negative_label", dict(y_test=np.array([0, -1, 2])), _spec(), r"y_test has negative labels \(min -1\)"),
    ("label_out_of_range", {}, _spec(num_classes=2), r"y_train has label 2 but num_classes=2"),
    ("float_labels", dict(y_train=np.array([0, 1, 2, 0, 1, 2], np.float32)), _spec(),
     r"y_train has non-integer dtype float32"),
    ("one_hot_labels", dict(y_train=np.eye(3)[[0, 1, 2, 0, 1, 2]].astype(int)), _spec(), r"one-hot.*argmax"),
    ("nan_train", dict(x_train=np.where(np.arange(96).reshape(6, 4, 4) == 5, np.nan, 0.5)), _spec(),
     r"x_train has 1 NaN and 0 inf value\(s\) in 1 example\(s\)"),
    ("inf_test", dict(x_train=np.zeros((6, 4, 4), np.float32),
                      x_test=np.array([np.inf, 0, -np.inf] * 16, np.float32).reshape(3, 4, 4)), _spec(),
     r"x_test has 0 NaN and 32 inf value\(s\) in 3 example\(s\)"),
    ("int64_images", dict(x_train=np.zeros((6, 4, 4), np.int64)), _spec(),
     r"x_train has dtype int64.*cast to uint8 or float32"),
    ("bool_images", dict(x_test=np.zeros((3, 4, 4), bool)), _spec(), r"x_test has dtype bool.*cast to uint8 or float32"),
    ("object_images", dict(x_train=np.empty((6, 2), object)), _spec(), r"x_train has dtype object.*cast to uint8 or float32"),
    ("string_inputs", dict(x_train=np.full((6, 2), "a")), _spec(), r"x_train has dtype <U1.*cast to uint8 or float32"),
    ("one_d_inputs", dict(x_train=np.zeros(6, np.float32)), _spec(), r"x_train has shape \(6,\), expected \[n, \.\.\.\]"),
    ("shape_mismatch", dict(x_test=np.zeros((3, 4, 4, 1), np.uint8)), _spec(),
     r"x_train examples have shape \(4, 4\) but x_test examples have \(4, 4, 1\)"),
    ("dtype_mismatch", dict(x_test=np.zeros((3, 4, 4), np.float32)), _spec(),
     r"x_train is uint8 but x_test is float32"),
    ("empty_train", dict(x_train=np.zeros((0, 4, 4), np.uint8), y_train=np.zeros(0, int)), _spec(),
     r"x_train is empty \(0 examples\)"),
    ("empty_test", dict(x_test=np.zeros((0, 4, 4), np.uint8), y_test=np.zeros(0, int)), _spec(), r"x_test is empty"),
    ("test_client_without_train", {}, dict(train_client_ids=[1, 1, 2, 2, 3, 3], test_client_ids=[1, 99, 3]),
     r"test_client_ids names client\(s\) 99 with no training examples"),
    ("empty_client_no_ids", {}, dict(partition="iid", num_clients=8, min_client_samples=0),
     r"client\(s\) 6, 7 have no training examples; use fewer clients \(at most 6\)"),
    ("only_train_ids", {}, dict(train_client_ids=[1, 1, 2, 2, 3, 3]),
     r"train_client_ids given without test_client_ids"),
    ("only_test_ids", {}, dict(test_client_ids=[1, 2, 3]), r"test_client_ids given without train_client_ids"),
    ("float_ids", {}, dict(train_client_ids=np.ones(6), test_client_ids=np.ones(3)),
     r"train_client_ids has dtype float64; client ids must be integers or strings"),
    ("mixed_id_types", {}, dict(train_client_ids=[1, 1, 2, 2, 3, 3], test_client_ids=["1", "2", "3"]),
     r"use the same id type"),
    ("min_samples_ids", {}, dict(train_client_ids=[1, 1, 1, 2, 2, 3], test_client_ids=[1, 2, 3],
                                 min_client_samples=2),
     r"client\(s\) 3 \(1\) have fewer than min_client_samples=2 training examples"),
    ("min_samples_spec", {}, dict(partition="iid", num_clients=3, min_client_samples=3),
     r"need 9 train examples; the training set has 6: use at most 2 clients"),
    ("no_spec", {}, dict(num_clients=3), r"without client ids, pass partition="),
    ("no_num_clients", {}, dict(partition="iid"), r"without client ids, pass partition=.*num_clients="),
    ("spec_conflicts_with_ids", {}, _ids(partition="iid"), r"partition='iid' conflicts with the client ids"),
    ("num_clients_conflicts_with_ids", {}, _ids(num_clients=5), r"num_clients=5 but the client ids name 3 clients"),
    ("bad_spec", {}, dict(partition="dirichlet:-1", num_clients=2), r"ALPHA must be > 0"),
    ("natural_without_ids", {}, dict(partition="natural", num_clients=2), r"partition 'natural' needs"),
    ("bad_min_samples", {}, _spec(min_client_samples=-1), r"min_client_samples must be an integer >= 0"),
    ("single_class", dict(y_train=np.zeros(6, int), y_test=np.zeros(3, int)), _spec(), r"every label is 0"),
    ("bad_num_classes", {}, _spec(num_classes=1), r"num_classes must be an integer >= 2, got 1"),
    ("huge_label", dict(y_train=np.array([0, 1, 2, 0, 1, 2**40])), _spec(), r"y_train has label 1099511627776, too large"),
    ("ragged_inputs", dict(x_train=[[0.5, 1.0], [0.5]] * 3), _spec(), r"x_train is not a rectangular array"),
    ("float32_overflow", dict(x_train=np.full((6, 2), 1e300), x_test=np.zeros((3, 2))), _spec(),
     r"x_train \(float64\) has values beyond the float32 range"),
    ("two_d_ids", {}, dict(train_client_ids=np.ones((6, 2), int), test_client_ids=[1, 1, 1]),
     r"train_client_ids has shape \(6, 2\), expected \[n\]"),
]


@pytest.mark.parametrize("overrides,kwargs,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_a_one_line_data_error(overrides, kwargs, message):
    with pytest.raises(DataError, match=message) as info:
        from_arrays(**small(**overrides), **kwargs)
    assert "\n" not in str(info.value) and str(info.value).startswith("arrays: ")


def test_partition_of_a_loaded_dataset(tmp_path):
    d = from_arrays(**small(), partition="iid", num_clients=2).dataset
    pdata = partition(d, "shards:1", 3, seed=1)
    assert isinstance(pdata, PartitionedData) and pdata.num_clients == 3
    with pytest.raises(DataError, match="needs 8 shards but the train set has only 6"):
        partition(d, "shards:2", 4)
    with pytest.raises(DataError, match="7 clients of at least 1 train example each .* use at most 6 clients"):
        partition(d, "shards:1", 7)
    with pytest.raises(DataError, match=r"client\(s\) .* have no training examples"):
        partition(d, "iid", 7, min_client_samples=0)


def test_partitioned_data_checks_its_parts():
    pdata = from_arrays(**small(), partition="iid", num_clients=2)
    with pytest.raises(DataError, match=r"3 client_names for 2 clients"):
        PartitionedData(pdata.dataset, pdata.partition, ("a", "b", "c"))
    with pytest.raises(DataError, match=r"arrays: unknown preprocessing 'bogus'"):
        pdata.to_federated("bogus")


# --------------------------------------------------------------------------- .npz files


def save(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_load_npz_round_trip_without_ids(tmp_path):
    a = small()
    path = save(tmp_path / "mine.npz", **a, extra=np.zeros(2))  # unknown keys are ignored
    for d in (load_npz(path), load("npz:" + path)):
        assert d.name == "npz:" + path and d.num_classes == 3
        assert d.train_client_ids is None and d.test_client_ids is None
        for key in ("x_train", "y_train", "x_test", "y_test"):
            split, kind = key.split("_")[1], key.split("_")[0]
            np.testing.assert_array_equal(getattr(d, f"{split}_{kind}"), a[key])
        assert d.train_y.dtype == np.int32 and d.train_x.dtype == np.uint8
    with pytest.raises(DataError, match="partition 'natural' needs"):
        partition(load_npz(path), "natural", 3)


@pytest.mark.fast
def test_load_npz_round_trip_with_ids(tmp_path):
    a = small()
    ids_train = np.array(["bob", "alice", "bob", "carol", "alice", "bob"])
    ids_test = np.array(["carol", "carol", "alice"])
    path = save(tmp_path / "ids.npz", **a, client_ids_train=ids_train, client_ids_test=ids_test)
    d = load_npz(path)
    assert d.train_client_ids.tolist() == [1, 0, 1, 2, 0, 1] and d.test_client_ids.tolist() == [2, 2, 0]
    assert d.train_client_ids.dtype == np.int32
    natural = partition(d, "natural", 3)
    direct = from_arrays(**a, train_client_ids=ids_train, test_client_ids=ids_test)
    assert natural.digest() == direct.digest()
    assert [t.tolist() for t in natural.partition.train_indices] == [[1, 4], [0, 2, 5], [3]]
    with pytest.raises(DataError, match="has 3 natural clients"):
        partition(d, "natural", 4)


def test_load_npz_errors(tmp_path):
    a = small()
    with pytest.raises(DataError, match=r"nope\.npz: no such file"):
        load_npz(tmp_path / "nope.npz")
    with pytest.raises(DataError, match="is a directory"):
        load_npz(tmp_path)
    (tmp_path / "text.npz").write_text("x_train,y_train\n1,2\n")
    with pytest.raises(DataError, match=r"text\.npz: not an \.npz file \(no zip header\)"):
        load_npz(tmp_path / "text.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(DataError, match=r"is a \.npy file holding one array"):
        load_npz(tmp_path / "one.npy")
    good = (tmp_path / "good.npz")
    save(good, **a)
    raw = good.read_bytes()
    (tmp_path / "trunc.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"trunc\.npz: damaged or truncated \.npz file"):
        load_npz(tmp_path / "trunc.npz")
    flipped = bytearray(raw)
    flipped[raw.find(b"\x93NUMPY") + 128 + 5] ^= 0x40  # one pixel of x_train: CRC mismatch
    (tmp_path / "crc.npz").write_bytes(bytes(flipped))
    with pytest.raises(DataError, match=r"crc\.npz: damaged or truncated \.npz file \(BadZipFile: Bad CRC-32"):
        load_npz(tmp_path / "crc.npz")
    save(tmp_path / "keys.npz", X_train=a["x_train"], y_train=a["y_train"], x_test=a["x_test"])
    with pytest.raises(DataError, match=r"missing key\(s\) x_train, y_test \(the file has: X_train, y_train, x_test\)"):
        load_npz(tmp_path / "keys.npz")
    save(tmp_path / "obj.npz", **dict(a, y_test=np.array([2, 1, None], dtype=object)))
    with pytest.raises(DataError, match=r"array 'y_test' holds Python objects.*allow_pickle=False"):
        load_npz(tmp_path / "obj.npz")
    save(tmp_path / "half.npz", **a, client_ids_test=np.array([1, 2, 3]))
    with pytest.raises(DataError, match="client_ids_test given without client_ids_train"):
        load_npz(tmp_path / "half.npz")
    save(tmp_path / "nan.npz", **dict(a, x_test=np.full((3, 4, 4), np.nan)))
    with pytest.raises(DataError, match=r"nan\.npz: x_test has 48 NaN"):
        load_npz(tmp_path / "nan.npz")
    path = str(good)
    with pytest.raises(DataError, match=r"unknown option\(s\) verify_checksums"):
        load("npz:" + path, verify_checksums=False)
    with pytest.raises(DataError, match="download=True does not apply"):   # the API's words
        load("npz:" + path, download=True)
    with pytest.raises(DataError, match="names no file"):
        load("npz:")
    with pytest.raises(DataError, match="read 'npz:.*' with fedjax_sparse.data.load"):
        load_dataset("npz:" + path)


# --------------------------------------------------------------------------- digest / describe


def test_digest_tracks_content():
    a = small()
    base = from_arrays(**a, partition="iid", num_clients=2, seed=0)
    d0 = base.digest()
    assert len(d0) == 64 and base.digest() == d0
    assert from_arrays(**small(), partition="iid", num_clients=2, seed=0, name="other").digest() == d0

    def changed(**kw):
        return from_arrays(**{**a, **kw}, partition="iid", num_clients=2, seed=0).digest()

    x = a["x_train"].copy()
    x[2, 1, 3] ^= 1
    assert changed(x_train=x) != d0
    xt = a["x_test"].copy()
    xt[0, 0, 0] ^= 1
    assert changed(x_test=xt) != d0
    y = a["y_train"].copy()
    y[4] = 0
    assert changed(y_train=y) != d0
    assert changed(y_test=np.array([2, 1, 1])) != d0
    assert from_arrays(**a, partition="iid", num_clients=2, seed=1).digest() != d0  # another partition
    assert changed(x_train=a["x_train"].astype(np.float32), x_test=a["x_test"].astype(np.float32)) != d0
    # Same bytes, another shape / another dtype (a Dataset from elsewhere may hold any dtype).
    assert changed(x_train=a["x_train"].reshape(6, 16), x_test=a["x_test"].reshape(3, 16)) != d0
    as_int16 = dataclasses.replace(base.dataset, train_x=base.dataset.train_x.view(np.int16),
                                   test_x=base.dataset.test_x.view(np.int16))
    as_float16 = dataclasses.replace(as_int16, train_x=as_int16.train_x.view(np.float16),
                                     test_x=as_int16.test_x.view(np.float16))
    assert PartitionedData(as_int16, base.partition).digest() != PartitionedData(as_float16, base.partition).digest()


def test_describe_is_json_ready():
    pdata = from_arrays(**small(), train_client_ids=["b", "a", "b", "c", "a", "b"], test_client_ids=["c", "c", "a"],
                        name="mine")
    desc = json.loads(json.dumps(pdata.describe()))
    assert desc["name"] == "mine" and desc["digest"] == pdata.digest()
    assert desc["arrays"]["train_x"] == {"shape": [6, 4, 4], "dtype": "uint8"}
    assert desc["arrays"]["test_y"] == {"shape": [3], "dtype": "int32"}
    assert desc["num_classes"] == 3 and desc["num_clients"] == 3 and desc["input_shape"] == [4, 4, 1]
    assert desc["partition"]["spec"] == "natural" and desc["partition"]["train_per_client"]["max"] == 3
    assert desc["client_names"] == ["a", "b", "c"]


def test_package_partition_is_the_front_door_function(shared_data):
    # fedjax_sparse.data.partitions is the function (the module stays importable by its path).
    from fedjax_sparse import data
    from fedjax_sparse.data.partitions import partition_dataset

    ds = data.load("fashion_mnist", shared_data)
    split = data.partition(ds, "iid", 5, seed=2)
    assert isinstance(split, data.PartitionedData) and split.num_clients == 5
    want = partition_dataset(ds, "iid", 5, 2)
    assert all((a == b).all() for a, b in zip(split.partition.train_indices, want.train_indices))


# --------------------------------------------------------------------------- CLI


def test_cli_runs_on_an_npz_file(tmp_path, capsys):
    rng = np.random.default_rng(0)
    ids = np.repeat([10, 20, 30], 20)
    path = save(tmp_path / "tiny.npz", x_train=rng.integers(0, 256, (60, 6, 6), dtype=np.uint8),
                y_train=rng.integers(0, 3, 60), x_test=rng.integers(0, 256, (12, 6, 6), dtype=np.uint8),
                y_test=rng.integers(0, 3, 12), client_ids_train=ids, client_ids_test=np.repeat([10, 30], 6))
    out = tmp_path / "run"
    args = ["run", "--dataset", "npz:" + path, "--partition", "natural", "--num-clients", "3",
            "--clients-per-round", "2", "--rounds", "2", "--algorithm", "fedavg", "--model", "mlp",
            "--local-epochs", "1", "--batch-size", "16", "--quiet", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(0 <= r["accuracy"] <= 1 for r in rows)
    assert json.loads((out / "config.json").read_text())["config"]["dataset"] == "npz:" + path
    capsys.readouterr()
    # Natural clients must match --num-clients; bad paths are one-line errors.
    for i, (bad, needle) in enumerate(((["--num-clients", "4"], "has 3 natural clients"),
                                       (["--dataset", "npz:" + str(tmp_path / "missing.npz")],
                                        "missing.npz: no such file"),
                                       (["--dataset", "npz:"], "names no file"))):
        assert main(args + bad + ["--out", str(tmp_path / f"bad{i}")]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.startswith("error: ") and err.count("\n") == 1, err
