"""The library's front door: ``import fedjax_sparse as fjs`` and a notebook's code as written."""
import dataclasses
import json
import textwrap

import flax.linen as nn
import numpy as np
import pytest
from sklearn.datasets import load_digits

import fedjax_sparse as fjs
from fedjax_sparse.cli import main as cli_main
from fedjax_sparse.mechanisms import supermask


def digits_arrays(clients=8, seed=0):
    """sklearn's 8x8 digits as a user's arrays, with the user's own (non-contiguous) client ids."""
    d = load_digits()
    x = (d.images[..., None] * 16).clip(0, 255).astype(np.uint8)
    y = d.target
    ids = np.random.default_rng(seed).choice(np.arange(100, 100 + 7 * clients, 7), len(y))
    return x[:1400], y[:1400], x[1400:], y[1400:], ids[:1400], ids[1400:]


class MyCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(32)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


class BiasFreeCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), padding="VALID", use_bias=False, name="conv")(x))   # 6x6x8
        return nn.Dense(10, use_bias=False, name="head")(x.reshape(x.shape[0], -1))     # 288 -> 10


class WithBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(12, (3, 3), name="conv")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, name="bn")(x))
        x = nn.relu(nn.Dense(24, name="fc")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="out")(x)


def test_the_issue_snippet_runs_as_written():
    x_train, y_train, x_test, y_test, train_client_ids, test_client_ids = digits_arrays()
    data = fjs.data.from_arrays(x_train, y_train, x_test, y_test, train_client_ids, test_client_ids)
    model = fjs.models.from_flax(MyCNN(), input_shape=(8, 8, 1))
    result = fjs.run(fjs.RunConfig(algorithm="spafl", rounds=2, clients_per_round=4), model=model, data=data,
                     progress=False)
    assert 0.0 <= result.summary["final_accuracy"] <= 1.0 and result.summary["rounds"] == 2
    assert type(result.state.server).__name__ == "SpaflServerState"
    assert not isinstance(result, tuple) and result.population is None
    assert data.num_clients == 8 and result.state.clients.tau["Conv_0"].shape == (8, 16)


def test_front_door_lists_a_curated_documented_api():
    for name in fjs.__all__:
        assert getattr(fjs, name) is not None, name
    for name in ("run", "RunConfig", "Engine", "Algorithm", "algorithms", "models", "data", "mechanisms",
                 "plot_runs", "report_table"):
        assert name in fjs.__all__
    assert callable(fjs.models.from_flax) and callable(fjs.data.from_arrays) and callable(fjs.data.load)
    # Each registered algorithm is a builder with typed keyword options.
    import inspect
    sig = inspect.signature(fjs.algorithms.spafl)
    assert sig.parameters["alpha"].default == 0.002 and sig.parameters["alpha"].annotation is float
    assert sig.parameters["alpha"].kind is inspect.Parameter.KEYWORD_ONLY


# ``fjs``'s names as they were before the package was split into layers (issue 49 item 1): each name's kind,
# qualified name and parameters (a namespace's: its ``__all__``). Moving a module must change none of them.
FRONT_DOOR = {
    "Algorithm": ("type", "Algorithm", ("name", "init", "broadcast", "client_update", "server_update",
                                        "personal_predict", "global_predict", "hparams", "personal_density",
                                        "extra_clients", "varying_cohort")),
    "ClientContext": ("type", "ClientContext", ("round", "client_id", "key", "shared_key")),
    "Engine": ("type", "Engine", ("algorithm", "num_clients", "clients_per_round", "client_parallelism",
                                  "eval_batch_size", "eval_shared_global_pass", "personal_eval", "shard_clients",
                                  "local_epochs", "batch_size", "resample_every", "cohort_schedule",
                                  "client_sampling", "client_rate", "pack_width")),
    "EngineState": ("type", "EngineState", ("server", "clients", "key", "round")),
    "Experiment": ("type", "Experiment", ("config", "dataset", "partition", "data", "task", "engine", "pinned",
                                          "data_record")),
    "Hooks": ("type", "Hooks", ("kernel", "activation")),
    "Model": ("type", "Model", ("name", "input_shape", "num_classes", "layers", "init_fn", "apply_fn", "sequential",
                                "channel_entries", "fixed_widths", "unit_drop_leaks", "other_macs",
                                "batch_norm_momentum", "row_leaks")),
    "RunConfig": ("type", "RunConfig", tuple(f.name for f in dataclasses.fields(fjs.RunConfig))),
    "RunError": ("type", "RunError", None),
    "RunResult": ("type", "RunResult", ("summary", "state", "population", "rows", "config")),
    "RunStopped": ("type", "RunStopped", ("signum", "round_", "out", "several")),
    "ServerContext": ("type", "ServerContext", ("round", "client_ids", "weights", "key", "extra_ids",
                                                "extra_messages", "mask")),
    "SweepResult": ("type", "SweepResult", ("members", "results", "rows", "best", "record")),
    "Task": ("type", "Task", ("model", "num_clients", "clients_per_round", "local_epochs", "batch_size", "lr",
                              "rounds", "preprocess", "seed", "initial_variables")),
    "algorithms": ("module", ["Algorithm", "ClientContext", "ServerContext", "Task", "algorithm_defaults",
                              "algorithm_names", "algorithm_options", "builder", "caldas", "client_metrics",
                              "fedadagrad", "fedadam", "fedavg", "fedavg_robust", "fedavgm", "feddrop", "fedpm",
                              "fedprox", "fedyogi", "fjord", "fsl", "heterofl", "local", "local_train",
                              "make_algorithm", "multi_krum", "predict_fn", "register_algorithm", "replicate",
                              "resolve_options", "scaffold", "sfsl", "sgd", "signsgd", "spafl", "spafl_local",
                              "spafl_no_eq13", "spafl_thresholds_only", "topk", "tree_weighted_mean",
                              "trimmed_mean", "unidrop"]),
    "build": ("function", "build", ("config", "model", "data", "algorithm")),
    "client_metrics": ("function", "client_metrics", ("loss", "num_examples", "flops", "uplink_bits",
                                                      "downlink_bits", "density", "extra")),
    "data": ("module", ["ClientData", "DATASETS", "DataError", "Dataset", "FederatedData", "Partition",
                        "PartitionedData", "build_federated_data", "from_arrays", "load", "load_dataset", "load_npz",
                        "partition", "partition_dataset", "partition_report"]),
    "format_summary": ("function", "format_summary", ("summary",)),
    "mechanisms": ("module", ["attacks", "robust_aggregation", "supermask", "syncdrop", "threshold_masks",
                              "widths"]),
    "models": ("module", ["Conv", "Dense", "Flatten", "GlobalAvgPool", "Hooks", "LayerInfo", "MaxPool", "Model",
                          "NO_HOOKS", "from_flax", "make_model", "model_names", "register_model", "sequential"]),
    "plot_runs": ("function", "plot_runs", ("paths", "out", "x", "y", "title")),
    "report_table": ("function", "report_table", ("paths",)),
    "run": ("function", "run", ("config", "model", "data", "algorithm", "resume", "overwrite", "progress", "on_eval",
                                "experiment", "given", "change")),
    "sweep": ("function", "sweep", ("config", "axes", "seeds", "parallelism", "select", "resume", "overwrite",
                                    "progress", "given", "keep_states", "model", "data", "algorithm")),
    "with_aggregator": ("function", "with_aggregator", ("alg", "aggregator", "trim_fraction", "krum_select",
                                                        "threat")),
    "with_attack": ("function", "with_attack", ("alg", "attack", "num_clients", "malicious_fraction", "seed",
                                                "knowledge", "threat", "deviation", "gamma_init", "search_steps",
                                                "attack_scale")),
    "with_dp": ("function", "with_dp", ("alg", "clip_norm", "noise_multiplier", "clients_per_round", "reference")),
}


def _described(obj):
    import inspect
    import types
    if isinstance(obj, types.ModuleType):
        return ("module", sorted(obj.__all__))
    try:
        parameters = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        parameters = None
    return (type(obj).__name__, obj.__qualname__, parameters)


def test_the_front_doors_names_are_unchanged_by_the_layout():
    """Every name of ``fjs.__all__`` is what it was before the layers, also once every module of the package has
    been imported (a submodule that took a name's place, as a subpackage ``run`` would take ``fjs.run``'s)."""
    import importlib
    import pkgutil
    for info in pkgutil.walk_packages(fjs.__path__, "fedjax_sparse."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    assert sorted(fjs.__all__) == sorted(FRONT_DOOR)
    assert {name: _described(getattr(fjs, name)) for name in fjs.__all__} == FRONT_DOOR


def test_a_notebook_cell_runs_twice():
    cell = textwrap.dedent('''
        import fedjax_sparse as fjs
        from fedjax_sparse.algorithms import register_algorithm
        from fedjax_sparse.models import register_model, sequential, Dense, Flatten

        @register_model("cell_mlp")
        def cell_mlp(input_shape, num_classes, **options):
            return sequential("cell_mlp", input_shape, num_classes,
                              [Flatten(), Dense("fc", num_classes, relu=False)], **options)

        @register_algorithm("cell_fedavg", {"server_lr": 1.0})
        def cell_fedavg(task, *, server_lr):
            return fjs.algorithms.fedavg(task, server_lr=server_lr)

        result = fjs.run(fjs.RunConfig(algorithm="cell_fedavg", model="cell_mlp", rounds=1, num_clients=4,
                                       clients_per_round=2), progress=False)
    ''')
    namespace = {"__name__": "__main__"}
    for _ in range(2):
        exec(compile(cell, "<notebook cell>", "exec"), namespace)
        assert namespace["result"].summary["rounds"] == 1
    # Another definition under a taken name is still refused.
    from fedjax_sparse.algorithms import register_algorithm
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm("cell_fedavg")(lambda task: None)


def my_fedavg(task):
    """FedAvg in a notebook: local SGD from the server model, a data-weighted mean back."""
    optimizer = fjs.algorithms.sgd(task.lr)

    def init(key):
        return {"variables": task.model.init(key)}, ()

    def broadcast(server, round_index):
        return server["variables"]

    def client_update(variables, client_state, data, ctx):
        new, _, stats = fjs.algorithms.local_train(
            task.model, optimizer, variables, optimizer.init(variables["params"]), data, ctx.key,
            epochs=task.local_epochs, batch_size=task.batch_size, preprocess=task.preprocess)
        return client_state, new, fjs.client_metrics(loss=stats.loss, num_examples=stats.num_examples)

    def server_update(server, messages, ctx):
        return {"variables": fjs.algorithms.tree_weighted_mean(messages, ctx.weights)}, {}

    def global_predict(server, x):
        return fjs.algorithms.predict_fn(task.model, server["variables"])(x)
    return fjs.Algorithm("my_fedavg", init, broadcast, client_update, server_update, global_predict=global_predict)


def test_an_algorithm_object_or_builder_runs_like_a_named_one(tmp_path):
    config = fjs.RunConfig(dataset="digits", model="cnn_small", rounds=2, num_clients=6, clients_per_round=3,
                           local_epochs=1, partition="iid")
    named = fjs.run(config, progress=False).summary
    as_builder = fjs.run(dataclasses.replace(config, algorithm=my_fedavg, out=str(tmp_path / "b")), progress=False).summary
    # FedAvg moves the server by old + 1.0 * (mean - old): equal to float rounding, not bitwise.
    assert as_builder["final_accuracy"] == pytest.approx(named["final_accuracy"], abs=1e-6)
    assert as_builder["final_global_accuracy"] == pytest.approx(named["final_global_accuracy"], abs=1e-6)
    recorded = json.loads((tmp_path / "b" / "config.json").read_text())
    assert recorded["config"]["algorithm"] == "my_fedavg" and recorded["data"]["digest"]
    # A built Algorithm object, and a named builder with an option, through run(algorithm=...).
    exp = fjs.build(config)
    tuned = fjs.algorithms.fedavg(exp.task, server_lr=0.5)
    assert fjs.run(config, algorithm=tuned, progress=False).summary["rounds"] == 2
    with pytest.raises(fjs.RunError, match="options already"):
        fjs.run(dataclasses.replace(config, options={"server_lr": 0.5}), algorithm=tuned)


# ------------------------------------------------------------------ exact bits on foreign models
def test_spafl_bits_on_a_foreign_model_are_32_per_threshold():
    model = fjs.models.from_flax(WithBatchNorm(), (8, 8, 1))
    assert [l.name for l in model.layers] == ["conv", "fc", "out"] and model.channel_entries == (("bn", "conv"),)
    rows = []
    fjs.run(fjs.RunConfig(algorithm="spafl", dataset="digits", rounds=2, num_clients=6, clients_per_round=3,
                          local_epochs=1, partition="iid"), model=model, progress=False,
            on_eval=lambda row, state, exp: rows.append(row))
    units = 12 + 24 + 10   # one threshold per output unit of every Dense/Conv
    for row in rows:
        assert row["uplink_bits"] == row["downlink_bits"] == 32 * units * 3


def test_fsl_ranking_bits_on_a_foreign_model():
    model = fjs.models.from_flax(BiasFreeCNN(), (8, 8, 1))
    rows = []
    fjs.run(fjs.RunConfig(algorithm="fsl", dataset="digits", rounds=1, num_clients=6, clients_per_round=3,
                          local_epochs=1, partition="iid", lr=0.1), model=model, progress=False,
            on_eval=lambda row, state, exp: rows.append(row))
    # Rankings of each layer's edges: n * ceil(log2 n) bits; conv 3*3*1*8 = 72 edges (7 bits), head
    # 288*10 = 2880 edges (12 bits); 3 clients up, 3 down.
    per_client = 72 * 7 + 2880 * 12
    assert supermask.ranking_bits([72, 2880]) == per_client
    assert rows[0]["uplink_bits"] == rows[0]["downlink_bits"] == 3 * per_client


# ------------------------------------------------------------------ the CLI: --model package.module:Name
@pytest.fixture(scope="module")
def fmnist_npz(shared_data, tmp_path_factory):
    ds = fjs.data.load("fashion_mnist", shared_data)
    path = tmp_path_factory.mktemp("npz") / "fmnist_small.npz"
    np.savez(path, x_train=ds.train_x[:240], y_train=ds.train_y[:240], x_test=ds.test_x[:60],
             y_test=ds.test_y[:60])
    return path


def test_cli_runs_the_flax_lenet_by_reference(fmnist_npz, tmp_path, capsys):
    out = tmp_path / "lenet"
    code = cli_main(["run", "--dataset", f"npz:{fmnist_npz}", "--model", "fedjax_sparse.models.flax_examples:LeNet5Caffe",
                     "--num-clients", "4", "--clients-per-round", "2", "--rounds", "1", "--local-epochs", "1",
                     "--batch-size", "32", "--partition", "iid", "--quiet", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["model"] == "fedjax_sparse.models.flax_examples:LeNet5Caffe"
    assert recorded["forward_macs_per_example"] == 2_293_000   # LeNet-5-Caffe on 28x28, as the zoo's
    assert recorded["data"]["num_clients"] == 4 and len(recorded["data"]["digest"]) == 64


TINY_CNN = textwrap.dedent('''
    import flax.linen as nn

    class TinyCNN(nn.Module):
        """Bias-free, so FSL's supernetwork accepts it."""
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3), padding="VALID", use_bias=False)(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            return nn.Dense(10, use_bias=False)(x.reshape(x.shape[0], -1))
''')


@pytest.mark.parametrize("algorithm", ["fedavg", "spafl", "feddrop", "fsl"])
def test_cli_runs_a_flax_linen_model_with_each_system(tmp_path, monkeypatch, algorithm, capsys):
    (tmp_path / "tiny_models.py").write_text(TINY_CNN)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / algorithm
    code = cli_main(["run", "--algorithm", algorithm, "--dataset", "digits", "--model", "tiny_models:TinyCNN",
                     "--num-clients", "4", "--clients-per-round", "2", "--rounds", "2", "--local-epochs", "1",
                     "--partition", "iid", "--quiet", "--out", str(out),
                     *(["--option", "opt_iters=100"] if algorithm == "feddrop" else [])])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["total_uplink_bits"] > 0 and rows[-1]["total_flops"] > 0


def test_cli_finds_a_model_next_to_the_command(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(textwrap.dedent('''
        import flax.linen as nn

        class TinyMLP(nn.Module):
            hidden: int = 16

            @nn.compact
            def __call__(self, x):
                x = nn.relu(nn.Dense(self.hidden)(x.reshape(x.shape[0], -1)))
                return nn.Dense(10)(x)
    '''))
    monkeypatch.chdir(tmp_path)
    args = ["run", "--algorithm", "spafl", "--dataset", "digits", "--num-clients", "4", "--clients-per-round", "2",
            "--rounds", "1", "--quiet", "--model", "my_models:TinyMLP", "--model-option", "hidden=8",
            "--out", str(tmp_path / "run")]
    assert cli_main(args) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["num_params"] == 64 * 8 + 8 + 8 * 10 + 10
    for bad, message in [("my_models:Nope", "has no attribute 'Nope'"), ("no_such_module:X", "cannot import")]:
        args[args.index("--model") + 1] = bad
        args[-1] = str(tmp_path / bad.replace(":", "_"))
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_resume_refuses_other_data(tmp_path):
    x_train, y_train, x_test, y_test, ids_train, ids_test = digits_arrays()
    config = fjs.RunConfig(algorithm="fedavg", model="cnn_small", rounds=1, clients_per_round=2,
                           out=str(tmp_path / "run"))
    data = fjs.data.from_arrays(x_train, y_train, x_test, y_test, ids_train, ids_test)
    fjs.run(config, data=data, progress=False)
    y_changed = y_train.copy()
    y_changed[0] = (y_changed[0] + 1) % 10
    other = fjs.data.from_arrays(x_train, y_changed, x_test, y_test, ids_train, ids_test)
    with pytest.raises(fjs.RunError, match="data differs"):
        fjs.run(dataclasses.replace(config, rounds=2), data=other, resume=True, progress=False)
    assert fjs.run(dataclasses.replace(config, rounds=2), data=data, resume=True,
                   progress=False).summary["rounds"] == 2


def test_width_scaling_and_federated_dropout_on_a_foreign_model_with_batchnorm():
    model = fjs.models.from_flax(WithBatchNorm(), (8, 8, 1))
    config = dict(dataset="digits", rounds=1, num_clients=6, clients_per_round=3, local_epochs=1, partition="iid")
    with pytest.raises(fjs.RunError, match=r"add RunConfig\(options=\{'sliced': False\}\)"):
        fjs.run(fjs.RunConfig(algorithm="heterofl", **config), model=model, progress=False)
    masked = fjs.run(fjs.RunConfig(algorithm="heterofl", options={"sliced": False}, **config), model=model,
                     progress=False)
    assert masked.summary["rounds"] == 1 and masked.summary["total_gbit"] > 0
    # Caldas' sub-models: the BatchNorm entry follows its conv's kept channels.
    dropped = fjs.run(fjs.RunConfig(algorithm="caldas", **config), model=model, progress=False)
    assert 0 < dropped.summary["final_density"] < 1
