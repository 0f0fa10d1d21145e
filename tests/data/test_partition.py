"""Tests for fedjax_sparse.data.partitions (on small label-only datasets, so they are fast)."""

import json

import numpy as np
import pytest

from fedjax_sparse.data.datasets import Dataset, load_dataset
from fedjax_sparse.data.partitions import (
    PARTITION_SCHEMES,
    format_partition_report,
    parse_partition_spec,
    partition_dataset,
    partition_report,
)

pytestmark = pytest.mark.fast   # the whole file is in the fast tier (python -m pytest -m fast)


def label_dataset(train_per_class=600, test_per_class=100, num_classes=10, seed=0) -> Dataset:
    """Balanced labels in random order; images are 1x1 placeholders (partitioning only reads labels)."""
    rng = np.random.default_rng(seed)
    train_y = rng.permutation(np.repeat(np.arange(num_classes), train_per_class)).astype(np.int32)
    test_y = rng.permutation(np.repeat(np.arange(num_classes), test_per_class)).astype(np.int32)
    return Dataset(
        "labels",
        np.zeros((len(train_y), 1, 1, 1), np.uint8),
        train_y,
        np.zeros((len(test_y), 1, 1, 1), np.uint8),
        test_y,
        num_classes,
    )


DS = label_dataset()


def assert_disjoint_cover(parts, n):
    all_idx = np.concatenate(parts)
    assert all(p.dtype == np.int64 for p in parts)
    assert len(all_idx) == n and np.array_equal(np.sort(all_idx), np.arange(n))


# --------------------------------------------------------------------------- spec parsing


def test_parse_specs():
    assert parse_partition_spec("iid") == ("iid", {})
    assert parse_partition_spec("dirichlet:0.3") == ("dirichlet", {"alpha": 0.3})
    assert parse_partition_spec("dirichlet_split:0.5") == ("dirichlet_split", {"alpha": 0.5, "train_fraction": 0.8})
    assert parse_partition_spec("dirichlet_split:0.5:0.7") == (
        "dirichlet_split",
        {"alpha": 0.5, "train_fraction": 0.7},
    )
    assert parse_partition_spec("shards:2") == ("shards", {"shards_per_client": 2})
    assert parse_partition_spec("natural") == ("natural", {})
    assert set(PARTITION_SCHEMES) == {"iid", "dirichlet", "dirichlet_split", "shards", "natural"}


@pytest.mark.parametrize(
    "spec",
    ["", "foo", "dirichlet", "dirichlet:0", "dirichlet:-1", "dirichlet:abc", "dirichlet:nan", "shards:0",
     "shards:1.5", "iid:3", "dirichlet_split:0.5:1.0", "dirichlet:0.5:0.8"],
)
def test_parse_bad_specs(spec):
    with pytest.raises(ValueError, match="valid forms: iid, dirichlet:ALPHA"):
        parse_partition_spec(spec)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_clients"):
        partition_dataset(DS, "iid", 0, seed=0)
    with pytest.raises(ValueError, match="needs 12000 shards but the train set has only 6000"):
        partition_dataset(DS, "shards:4", 3000, seed=0)
    with pytest.raises(ValueError, match=r"use at most 6000 clients \(--num-clients\)"):
        partition_dataset(DS, "iid", 7000, seed=0)


# --------------------------------------------------------------------------- coverage and determinism


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.5", "shards:2"])
def test_train_indices_disjoint_and_covering(spec):
    p = partition_dataset(DS, spec, 20, seed=3)
    assert p.num_clients == 20 and not p.test_from_train and p.num_classes == 10
    assert_disjoint_cover(p.train_indices, 6000)
    assert_disjoint_cover(p.test_indices, 1000)  # every test sample used once as well


@pytest.mark.parametrize("spec", ["iid", "dirichlet:0.5", "dirichlet_split:0.5", "shards:2"])
def test_deterministic_given_seed(spec):
    a = partition_dataset(DS, spec, 10, seed=7)
    b = partition_dataset(DS, spec, 10, seed=7)
    c = partition_dataset(DS, spec, 10, seed=8)
    for x, y in zip(a.train_indices + a.test_indices, b.train_indices + b.test_indices):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(a.train_indices, c.train_indices))


def test_iid_sizes_balanced():
    p = partition_dataset(DS, "iid", 7, seed=0)
    sizes = [len(t) for t in p.train_indices]
    assert max(sizes) - min(sizes) <= 1


# --------------------------------------------------------------------------- dirichlet


def test_dirichlet_alpha_controls_skew():
    skewed = partition_report(DS, partition_dataset(DS, "dirichlet:0.1", 20, seed=0))
    flat = partition_report(DS, partition_dataset(DS, "dirichlet:100", 20, seed=0))
    s_skew = skewed["summary"]["mean_classes_over_5pct_per_client"]
    s_flat = flat["summary"]["mean_classes_over_5pct_per_client"]
    assert s_skew < 4 and s_flat > 9 and s_skew < s_flat


def test_dirichlet_test_follows_train_mix():
    ds = label_dataset(train_per_class=3000, test_per_class=1000)
    p = partition_dataset(ds, "dirichlet:0.5", 10, seed=1)
    rep = partition_report(ds, p)
    for client in rep["clients"]:
        tr = np.array(client["train_counts"], float)
        te = np.array(client["test_counts"], float)
        if te.sum() < 200:
            continue
        tr_share, te_share = tr / tr.sum(), te / te.sum()
        # Same q_c for train and test: shares agree up to the integer cuts.
        assert np.abs(tr_share - te_share).max() < 0.03
        assert np.corrcoef(tr, te)[0, 1] > 0.99


def test_dirichlet_min_train_samples_respected_and_impossible():
    p = partition_dataset(DS, "dirichlet:0.1", 20, seed=0, min_train_samples=50)
    assert min(len(t) for t in p.train_indices) >= 50
    with pytest.raises(ValueError, match=r"--min-client-samples \(min_train_samples\) is too large"):
        partition_dataset(DS, "dirichlet:0.05", 50, seed=0, min_train_samples=119, max_redraws=5)


# --------------------------------------------------------------------------- dirichlet_split


def test_dirichlet_split_train_test_disjoint_fraction():
    p = partition_dataset(DS, "dirichlet_split:0.3", 10, seed=0, min_train_samples=10)
    assert p.test_from_train
    for tr, te in zip(p.train_indices, p.test_indices):
        assert len(np.intersect1d(tr, te)) == 0
        assert len(te) >= 1 and len(tr) >= 10
        assert abs(len(tr) / (len(tr) + len(te)) - 0.8) < 0.06
    assert_disjoint_cover(p.train_indices + p.test_indices, 6000)
    rep = partition_report(DS, p)
    assert rep["totals"]["train"] + rep["totals"]["test"] == 6000


def test_dirichlet_split_custom_fraction():
    p = partition_dataset(DS, "dirichlet_split:10:0.5", 4, seed=0)
    total_train = sum(len(t) for t in p.train_indices)
    assert abs(total_train / 6000 - 0.5) < 0.01


# --------------------------------------------------------------------------- shards


def test_shards_at_most_two_labels():
    ds = label_dataset(train_per_class=100, test_per_class=20)  # 1000 samples, 100 shards of 10
    p = partition_dataset(ds, "shards:2", 50, seed=0)
    assert_disjoint_cover(p.train_indices, 1000)
    for tr, te in zip(p.train_indices, p.test_indices):
        train_labels = set(np.unique(ds.train_y[tr]).tolist())
        assert len(tr) == 20 and len(train_labels) <= 2
        # Test samples only come from labels the client holds.
        assert set(np.unique(ds.test_y[te]).tolist()) <= train_labels
    assert_disjoint_cover(p.test_indices, 200)


# --------------------------------------------------------------------------- natural


def test_natural_uses_client_ids():
    ds = load_dataset("synthetic", num_clients=8, seed=2)
    p = partition_dataset(ds, "natural", 8, seed=0)
    for k, (tr, te) in enumerate(zip(p.train_indices, p.test_indices)):
        assert np.all(ds.train_client_ids[tr] == k) and np.all(ds.test_client_ids[te] == k)
    assert_disjoint_cover(p.train_indices, len(ds.train_y))
    with pytest.raises(ValueError, match="has 8 natural clients.*set num_clients=8"):
        partition_dataset(ds, "natural", 5, seed=0)
    with pytest.raises(ValueError, match="has none"):
        partition_dataset(DS, "natural", 5, seed=0)


# --------------------------------------------------------------------------- reports


def test_report_counts_and_format():
    p = partition_dataset(DS, "dirichlet:0.5", 30, seed=0)
    rep = partition_report(DS, p)
    json.dumps(rep)  # JSON-able
    assert rep["totals"]["train"] == 6000 and rep["totals"]["test"] == 1000
    assert sum(c["train_total"] for c in rep["clients"]) == 6000
    assert all(sum(c["train_counts"]) == c["train_total"] for c in rep["clients"])
    assert rep["totals"]["train_per_class"] == [600] * 10
    assert rep["summary"]["train_samples"]["mean"] == pytest.approx(200.0)
    text = format_partition_report(rep, max_rows=5)
    assert "client" in text and "train" in text and "test" in text and "classes" in text
    assert "(25 more clients)" in text
    assert len(text.splitlines()) == 4 + 5 + 1
