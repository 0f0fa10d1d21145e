"""One KEY=VALUE grammar and one typed reading (issue 49 item 2): ``--option``, ``--model-option``,
``--dataset-option``, ``--sweep``, ``bench --compare`` and ``--change`` read ``KEY=V`` alike, and a value
is typed by what its key declares (a RunConfig or Execution field's annotation, the algorithm's typed
options, the model's and the data set's option schemas), so ``dataset_option.iid=false`` is False."""
import pytest

from fedjax_sparse.tools import bench
from fedjax_sparse.driver import sweeps
from fedjax_sparse.cli import _parser, config_from_args, main
from fedjax_sparse.driver.config import RunConfig, parse_overrides, typed_value, with_overrides
from fedjax_sparse.errors import RunError
from fedjax_sparse.driver.runner import changed_config, resumed_config

SPAFL = RunConfig(algorithm="spafl", dataset="digits", model="mlp")


def flags(*argv):
    return config_from_args(_parser().parse_args(["run", *argv]))[0]


@pytest.mark.fast
def test_one_grammar_for_every_key_value_flag():
    assert parse_overrides(["lr=0.1", " option.alpha = 0.01 ", "options.ramp=true"], "--change") == {
        "lr": "0.1", "option.alpha": "0.01", "option.ramp": "true"}
    assert parse_overrides(["lr=0.1,1", "xla_flags=none;--a=1,2"], "--compare", lists=True) == {
        "lr": ["0.1", "1"], "xla_flags": ["none", "--a=1,2"]}
    # The three callers are the one parser: the same words for the same mistake.
    for parse, flag in ((sweeps.parse_sweep, "--sweep"), (bench.parse_compare, "--compare")):
        with pytest.raises(RunError, match=f"^{flag} takes KEY=V1,V2, got 'lr': write {flag} lr=V1,V2$"):
            parse(["lr"])
        with pytest.raises(RunError, match=f"^{flag} 'lr=0.1,,1' has an empty value"):
            parse(["lr=0.1,,1"])
    with pytest.raises(RunError, match="^--change takes KEY=VALUE, got 'lr': write --change lr=VALUE$"):
        parse_overrides(["lr"], "--change")


@pytest.mark.fast
def test_a_value_takes_the_type_its_key_declares():
    cases = [("lr", "1", 1), ("lr", "0.01", 0.01), ("lr", "none", None), ("aggregator", "none", None),
             ("partition", "iid", "iid"), ("download", "false", False), ("eval_batch_size", "64", 64),
             ("client_parallelism", "map", "map"), ("option.ramp", "no", False), ("option.alpha", "0.01", 0.01),
             ("option.alpha", "1", 1), ("model_option.hidden", "100", 100), ("model_option.init", "3", "3"),
             ("dataset_option.test_fraction", "0.5", 0.5)]
    for key, text, value in cases:
        typed = typed_value(SPAFL, key, text, "sweep")
        assert typed == value and type(typed) is type(value), (key, text, typed)
    synthetic = RunConfig(dataset="synthetic")
    assert typed_value(synthetic, "dataset_option.iid", "false", "sweep") is False
    # A user's Flax module declares no schema: its options are read as JSON spells them.
    assert typed_value(RunConfig(model="mine:Net"), "model_option.width", "8", "model_option") == 8
    for key, text, needle in (("rounds", "many", "--sweep rounds='many': expected an integer"),
                              ("option.ramp", "maybe", "--option ramp='maybe' of algorithm spafl"),
                              ("model_option.hidden", "wide", "--model-option hidden='wide' of model mlp: expected "
                                                              "an integer"),
                              ("dataset_option.bogus", "1", "digits: unknown option(s) bogus (--dataset-option "
                                                            "KEY=VALUE); valid options: test_fraction=0.2, "
                                                            "split_seed=0")):
        with pytest.raises(ValueError, match=None) as error:
            typed_value(SPAFL, key, text, "sweep")
        assert needle in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.fast
def test_the_cli_types_options_as_python_gives_them(capsys):
    config = flags("--algorithm", "spafl", "--option", "alpha=0.01", "--option", "ramp=false", "--model",
                   "mlp", "--model-option", "hidden=64", "--model-option", "init=torch",
                   "--dataset", "synthetic", "--dataset-option", "iid=false")
    assert config == RunConfig(algorithm="spafl", options={"alpha": 0.01, "ramp": False}, model="mlp",
                               model_options={"hidden": 64, "init": "torch"}, dataset="synthetic",
                               dataset_options={"iid": False})
    code = main(["run", "--dataset", "digits", "--dataset-option", "iid=false", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err == ("error: digits: unknown option(s) iid (--dataset-option KEY=VALUE); valid options: "
                                 "test_fraction=0.2, split_seed=0\n"), err


@pytest.mark.fast
def test_change_and_resume_compare_typed_values():
    config = RunConfig(algorithm="spafl", lr=0.1, options={"ramp": True, "alpha": 0.01})
    changed, what = changed_config(config, {"option.ramp": "false", "option.alpha": "0.01", "lr": "0.05"})
    assert changed.options == {"ramp": False, "alpha": 0.01} and changed.lr == 0.05
    assert what == {"option.ramp": {"from": True, "to": False}, "lr": {"from": 0.1, "to": 0.05}}
    # A resumed run's flags are text (typed against the recorded configuration): "true" is the recorded True,
    # and a run recorded by an earlier version with the text "0.01" is resumed by the typed 0.01.
    given = RunConfig(options={"ramp": "true", "alpha": 0.01})
    recorded = RunConfig(algorithm="spafl", options={"ramp": True, "alpha": "0.01"})
    merged, _ = resumed_config(given, recorded, {"options"})
    assert merged.options == recorded.options
    with pytest.raises(RunError, match="would change the experiment"):
        resumed_config(RunConfig(options={"ramp": "false"}), recorded, {"options"})


@pytest.mark.fast
def test_with_overrides_sets_fields_execution_and_each_options_dict():
    config = with_overrides(SPAFL, {"lr": 0.5, "client_parallelism": "map", "option.alpha": 0.1,
                                    "model_option.hidden": 8, "dataset_option.split_seed": 2})
    assert (config.lr, config.execution.client_parallelism, config.options, config.model_options,
            config.dataset_options) == (0.5, "map", {"alpha": 0.1}, {"hidden": 8}, {"split_seed": 2})
    assert SPAFL.options == {} and SPAFL.execution.client_parallelism == "auto"   # a new configuration


@pytest.mark.fast
def test_a_configuration_is_frozen_and_says_how_to_change_it():
    import dataclasses
    from fedjax_sparse.driver.experiment import Experiment
    config = RunConfig(lr=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"^RunConfig is frozen: use config.replace\(lr=\.\.\.\) "
                                                              r"or dataclasses.replace\(config, lr=\.\.\.\)"):
        config.lr = 0.2
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"^Execution is frozen: use config.replace\(log=\.\.\.\)"):
        config.execution.log = "csv"
    changed = config.replace(rounds=3, client_parallelism="map")
    assert (changed.rounds, changed.execution.client_parallelism, changed.lr) == (3, "map", 0.1)
    assert (config.rounds, config.execution.client_parallelism) == (30, "auto")   # a new configuration
    assert changed == dataclasses.replace(config, rounds=3, execution=dataclasses.replace(config.execution,
                                                                                          client_parallelism="map"))
    assert Experiment.__dataclass_params__.frozen


@pytest.mark.fast
def test_a_configurations_option_dicts_are_read_only_and_travel_as_dicts():
    import copy
    import json
    import pickle
    given = {"alpha": 0.01}
    config = RunConfig(algorithm="spafl", options=given, model_options={"hidden": 8}, dataset_options={"iid": True})
    given["alpha"] = 1.0   # the caller's dict is not the configuration's
    for field in ("options", "model_options", "dataset_options"):
        mapping = getattr(config, field)
        fix = rf"^RunConfig.{field} is read-only: use config.replace\({field}=\{{\.\.\.\}}\)"
        for change in (lambda m: m.__setitem__("x", 1), lambda m: m.update(x=1), lambda m: m.setdefault("x", 1),
                       lambda m: m.pop("x", None), lambda m: m.__delitem__("x"), lambda m: m.clear(),
                       lambda m: m.popitem()):
            with pytest.raises(TypeError, match=fix):
                change(mapping)
    assert (config.options, config.model_options, config.dataset_options) == ({"alpha": 0.01}, {"hidden": 8},
                                                                              {"iid": True})
    assert config.replace(options={"alpha": 0.02}).options == {"alpha": 0.02}
    assert with_overrides(config, {"option.alpha": 0.03}).options == {"alpha": 0.03} and config.options["alpha"] == 0.01
    for copied in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config), copy.copy(config)):
        assert copied == config
        with pytest.raises(TypeError, match="read-only"):
            copied.options["x"] = 1
    written = config.to_json()
    assert RunConfig.from_json(json.loads(json.dumps(written))) == config
    assert all(type(written[field]) is dict for field in ("options", "model_options", "dataset_options"))


def test_a_run_checks_its_configuration_and_sets_the_default_lr_once(tmp_path, monkeypatch, capsys):
    """On the CLI's path and fjs.run's, fresh and resumed (``--change`` too): one validation, before the
    folder is written (a resumed run's: the recorded configuration merged), and one default learning rate."""
    import sys
    import fedjax_sparse as fjs
    from fedjax_sparse.driver import catalog, config as config_module
    calls = {"validate": 0, "with_default_lr": 0, "default_lr": 0}

    def counted(name, function):
        def count(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return count
    for name, module in [("validate", config_module), ("with_default_lr", config_module), ("default_lr", catalog)]:
        original, replacement = getattr(module, name), counted(name, getattr(module, name))
        for other in [m for key, m in list(sys.modules.items()) if key.startswith("fedjax_sparse")]:
            if getattr(other, name, None) is original:
                monkeypatch.setattr(other, name, replacement)

    def once(run):
        calls.update(validate=0, with_default_lr=0, default_lr=0)
        run()
        assert calls == {"validate": 1, "with_default_lr": 1, "default_lr": 1}, calls
    quick = ["--dataset", "synthetic", "--num-clients", "4", "--clients-per-round", "2", "--local-epochs", "1",
             "--quiet"]
    once(lambda: main(["run", *quick, "--rounds", "1", "--out", str(tmp_path / "cli")]))
    once(lambda: main(["run", *quick, "--rounds", "2", "--out", str(tmp_path / "cli"), "--resume", "--change",
                       "lr=0.05"]))
    config = RunConfig(dataset="synthetic", num_clients=4, clients_per_round=2, local_epochs=1, rounds=1,
                       out=str(tmp_path / "api"))
    once(lambda: fjs.run(config, progress=False))
    once(lambda: fjs.run(config.replace(rounds=2), progress=False, resume=True))
    with pytest.raises(RunError, match="rounds.* must be a positive integer, got 0"):
        fjs.run(config.replace(rounds=0, out=str(tmp_path / "refused")), progress=False)
    assert not (tmp_path / "refused").exists()   # refused before the folder is made
    capsys.readouterr()
