"""Pinned draws: a partition file, initial parameters and a cohort schedule
replay another run's random draws exactly."""
import json

import jax
import numpy as np
import pytest

from fedjax_sparse.driver import pinning, runner
from fedjax_sparse.cli import main
from fedjax_sparse.models import make_model

BASE = dict(algorithm="fedavg", dataset="digits", num_clients=6, clients_per_round=3, local_epochs=1,
            batch_size=32, lr=0.1, partition="dirichlet:0.5", eval_every=1, rounds=3)


def rows_of(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_curves(a, b):
    keys = ("accuracy", "loss", "global_accuracy", "uplink_bits", "flops", "total_flops")
    return [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]


def test_partition_file_written_by_the_cli_replays_the_partition(tmp_path, capsys):
    assert main(["partition", "--dataset", "digits", "--num-clients", "6", "--partition", "dirichlet:0.5",
                 "--seed", "4", "--out", str(tmp_path / "p")]) == 0
    doc = json.loads((tmp_path / "p" / "partition.json").read_text())
    assert doc["format"] == pinning.PARTITION_FORMAT and doc["dataset"] == "digits" and doc["seed"] == 4
    assert doc["spec"] == "dirichlet:0.5" and doc["num_clients"] == 6
    assert all(len(c["train_indices"]) == c["train_total"] for c in doc["clients"])
    # The file carries the partition: a run with it and another seed equals the run with seed 4's own
    # partition, as far as the partition matters (same init/cohorts need the same seed: use seed 4).
    plain = runner.RunConfig(**{**BASE, "seed": 4}, out=str(tmp_path / "plain"))
    pinned = runner.RunConfig(**{**BASE, "seed": 4, "partition": "iid"}, out=str(tmp_path / "pinned"),
                              partition_file=str(tmp_path / "p" / "partition.json"))
    runner.run(plain, progress=False)
    runner.run(pinned, progress=False)
    assert _same_curves(rows_of(tmp_path / "plain"), rows_of(tmp_path / "pinned"))
    config = json.loads((tmp_path / "pinned" / "config.json").read_text())
    assert config["pinned_draws"]["partition_file"]["sha256"] == pinning.file_digest(
        tmp_path / "p" / "partition.json")


def test_all_three_pinned_files_make_two_seeds_agree_except_local_shuffles(tmp_path):
    """Seeds 0 and 1 with the same partition file, init params and cohort schedule start from the
    same model, sample the same clients and hold the same data; only the local shuffles (private
    keys) differ. The pinned pieces are checked directly."""
    exp0 = runner.build(runner.RunConfig(**BASE, seed=0))
    part = pinning.partition_to_json(exp0.partition, dataset="digits", seed=0)
    (tmp_path / "part.json").write_text(json.dumps(part))
    init = make_model("cnn_small", exp0.data.input_shape, exp0.data.num_classes).init(jax.random.PRNGKey(42))
    pinning.save_init_params(init, tmp_path / "init.npz")
    schedule = [[5, 0, 2], [1, 3, 4], [2, 5, 1]]
    pinning.write_cohort_schedule(schedule, tmp_path / "cohorts.json")
    files = dict(partition_file=str(tmp_path / "part.json"), init_params=str(tmp_path / "init.npz"),
                 cohort_schedule=str(tmp_path / "cohorts.json"))
    for seed in (0, 1):
        exp = runner.build(runner.RunConfig(**{**BASE, "partition": "iid"}, seed=seed, **files))
        state = exp.engine.init(jax.random.PRNGKey(seed))
        for a, b in zip(jax.tree_util.tree_leaves(state.server.variables), jax.tree_util.tree_leaves(init)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for r, row in enumerate(schedule):
            assert np.asarray(exp.engine.cohort(state.key, np.int32(r))).tolist() == row
        np.testing.assert_array_equal(np.asarray(exp.data.train_idx), np.asarray(exp0.data.train_idx))


def test_cohort_schedule_drives_the_sampled_clients(tmp_path):
    """Local training: exactly the scheduled clients change in each round."""
    pinning.write_cohort_schedule([[4, 1], [0, 5]], tmp_path / "c.json")
    config = runner.RunConfig(**{**BASE, "algorithm": "local", "clients_per_round": 2, "rounds": 2},
                              cohort_schedule=str(tmp_path / "c.json"))
    exp = runner.build(config)
    state = exp.engine.init(jax.random.PRNGKey(0))
    before = np.asarray(state.clients.variables["params"]["conv1"]["kernel"])
    state, _ = exp.engine.run_rounds(state, exp.data, 1)
    after = np.asarray(state.clients.variables["params"]["conv1"]["kernel"])
    changed = [i for i in range(6) if not np.array_equal(before[i], after[i])]
    assert changed == [1, 4]


@pytest.mark.fast
def test_params_from_torch_reorders_the_flattened_conv_map():
    """A PyTorch linear after a conv flattens (c, h, w); ours reads (h, w, c). Every weight is
    tagged with its (out, c, h, w) coordinates and must land at row (h*W + w)*C + c."""
    model = make_model("lenet5_caffe", (28, 28, 1), 10)
    rng = np.random.default_rng(0)
    sd = {"conv1.weight": rng.normal(size=(20, 1, 5, 5)), "conv2.weight": rng.normal(size=(50, 20, 5, 5)),
          "fc3.weight": np.zeros((500, 800)), "fc4.weight": rng.normal(size=(10, 500))}
    o, c, h, w = np.meshgrid(np.arange(500), np.arange(50), np.arange(4), np.arange(4), indexing="ij")
    code = o * 10_000 + c * 100 + h * 10 + w
    sd["fc3.weight"] = code.reshape(500, 800).astype(np.float64)
    params = pinning.params_from_torch(model, sd)["params"]
    fc1 = params["fc1"]["kernel"]
    for (oo, cc, hh, ww) in [(0, 0, 0, 0), (7, 3, 2, 1), (499, 49, 3, 3), (12, 10, 0, 3)]:
        assert fc1[(hh * 4 + ww) * 50 + cc, oo] == oo * 10_000 + cc * 100 + hh * 10 + ww
    np.testing.assert_array_equal(params["conv2"]["kernel"][1, 2, 3, 4], np.float32(sd["conv2.weight"][4, 3, 1, 2]))
    np.testing.assert_array_equal(params["fc2"]["kernel"], sd["fc4.weight"].T.astype(np.float32))


@pytest.mark.parametrize("case, message", [
    ("clients", "has 5 clients, but --num-clients is 6"),
    ("index", "outside [0,"),
    ("format", "is not a fedjax_sparse.partition/1 file"),
])
def test_bad_partition_files_are_one_line_errors(tmp_path, capsys, case, message):
    exp = runner.build(runner.RunConfig(**BASE))
    doc = pinning.partition_to_json(exp.partition, dataset="digits")
    if case == "clients":
        doc["clients"] = doc["clients"][:5]
    elif case == "index":
        doc["clients"][2]["train_indices"][0] = 10 ** 6
    else:
        doc["format"] = "something/0"
    (tmp_path / "p.json").write_text(json.dumps(doc))
    code = main(["run", "--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3", "--rounds", "1",
                 "--partition-file", str(tmp_path / "p.json"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_init_params_and_schedules_are_one_line_errors(tmp_path, capsys):
    np.savez(tmp_path / "wrong.npz", **{"params/conv1/kernel": np.zeros((3, 3, 1, 2))})
    pinning.write_cohort_schedule([[0, 1, 2]], tmp_path / "short.json")
    pinning.write_cohort_schedule([[0, 0, 2], [1, 2, 3]], tmp_path / "dup.json")
    for flag, path, message in (("--init-params", "wrong.npz", "does not match the model"),
                                ("--cohort-schedule", "short.json", "lists 1 rounds but --rounds is 2"),
                                ("--cohort-schedule", "dup.json", "distinct client ids"),
                                ("--init-params", "missing.npz", "no such file")):
        code = main(["run", "--dataset", "digits", "--num-clients", "6", "--clients-per-round", "3",
                     "--rounds", "2", flag, str(tmp_path / path), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
