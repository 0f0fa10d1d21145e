"""Errors in the words of the caller (issue 42 item 3; issue 49 item 2): a message names each setting
once, with ``errors.arg``, which words it when the message is made: the Python argument within the API's
entry points (``fjs.run``, ``fjs.sweep``, ``fjs.build``, ``fjs.data.load``, ``make_model``), the flag on
the command line (``errors.cli_caller``) and elsewhere. Nothing rewrites a message afterwards."""
import ast
import re
from pathlib import Path

import pytest

import fedjax_sparse as fjs
from fedjax_sparse import errors
from fedjax_sparse.cli import RUN_FLAGS, main
from fedjax_sparse.errors import arg, cli_caller, in_callers_words, resume_command

SOURCE = Path(fjs.__file__).parent
QUICK = dict(dataset="digits", num_clients=4, clients_per_round=2, rounds=1, local_epochs=1, batch_size=32,
             partition="iid")
QUICK_FLAGS = ["--dataset", "digits", "--num-clients", "4", "--clients-per-round", "2", "--rounds", "1",
               "--local-epochs", "1", "--partition", "iid", "--quiet"]
# The flags an API caller sets as arguments: run's configuration flags and run's own.
TRANSLATED = [flag for flag, *_ in RUN_FLAGS] + ["--option", "--model-option", "--dataset-option", "--sweep",
                                                 "--seeds", "--resume", "--overwrite", "--download", "--sweep-select",
                                                 "--replica-parallelism", "--change", "--setting"]
LEFT = re.compile("(" + "|".join(re.escape(f) for f in sorted(TRANSLATED, key=len, reverse=True)) + r")(?![a-z-])")


def raised_messages():
    """Every message a ``raise X(...)`` or ``warnings.warn(...)`` in the package writes, its literal text
    (f-string fields as ``X``), with its file and line."""
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                message = node.exc.args[0]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "warn" and node.args:
                message = node.args[0]
            else:
                continue
            parts = []
            for arg_node in ast.walk(message):
                if isinstance(arg_node, ast.Constant) and isinstance(arg_node.value, str):
                    parts.append(arg_node.value)
                elif isinstance(arg_node, ast.FormattedValue):
                    parts.append("X")
            yield f"{path.relative_to(SOURCE)}", node.lineno, "".join(parts)


@pytest.mark.fast
def test_no_message_writes_a_run_flag_itself():
    """A message names a setting with errors.arg (worded for its reader), never as a flag's text: the
    command line's own messages (cli.py) aside, and the algorithm registry's two (its owner's file; a run
    checks options in config.algorithm_option_values first, in its reader's words)."""
    messages = list(raised_messages())
    assert len(messages) > 300   # the scan finds them (config, runner, checkpoint, sweeps, data, models...)
    left = [(where, line, text) for where, line, text in messages if LEFT.search(text)
            and where not in ("cli.py", "algorithms/registry.py")]
    assert left == []


@pytest.mark.fast
def test_arg_spells_each_setting_for_its_reader():
    cases = [(("lr",), "--lr", "RunConfig(lr=...)"),
             (("client_state", "host"), "--client-state host", "RunConfig(execution=Execution(client_state='host'))"),
             (("client_parallelism", "bucketed"), "--client-parallelism bucketed",
              "RunConfig(execution=Execution(client_parallelism='bucketed'))"),
             (("resume",), "--resume", "resume=True"), (("overwrite",), "--overwrite", "overwrite=True"),
             (("option", "init=model"), "--option init=model", "RunConfig(options={'init': 'model'})"),
             (("option", "sliced=false"), "--option sliced=false", "RunConfig(options={'sliced': False})"),
             (("option", "KEY=VALUE"), "--option KEY=VALUE", "RunConfig(options={KEY: VALUE})"),
             (("model_option",), "--model-option", "RunConfig(model_options=...)"),
             (("sweep", "lr=0.01,0.1"), "--sweep lr=0.01,0.1", "axes={'lr': [0.01, 0.1]}"),
             (("seeds", [0, 1, 2]), "--seeds 0 1 2", "seeds=[0, 1, 2]"),
             (("dp_clip", "C"), "--dp-clip C", "RunConfig(dp_clip=C)"),
             (("partition_file", "/a/b.json"), "--partition-file /a/b.json", "RunConfig(partition_file='/a/b.json')"),
             (("change", "lr=VALUE"), "--change lr=VALUE", "change={'lr': VALUE}")]

    @in_callers_words
    def entry_point(*args):
        return arg(*args)
    for args, cli, python in cases:
        assert arg(*args) == cli, args   # outside an entry point: a module's function called directly
        with cli_caller():
            assert entry_point(*args) == cli, args
        assert entry_point(*args) == python, args
    assert arg("setting", "spafl", quote=True) == "--setting 'spafl'"
    assert in_callers_words(lambda: resume_command("/tmp/x"))() == "fjs.run(config, resume=True) with config.out='/tmp/x'"
    assert resume_command("/tmp/x") == "python -m fedjax_sparse run --out /tmp/x --resume"
    load_words = in_callers_words(arguments={"download": ("download=True",) * 2})(lambda: arg("download"))
    assert load_words() == "download=True" and errors.arg("download") == "--download"


def test_a_second_run_into_a_finished_folder_names_arguments_in_python_and_flags_on_the_cli(tmp_path, capsys):
    """The issue's case: the API said "pass --resume ... --overwrite ..." where it takes resume=True."""
    out = tmp_path / "run"
    config = fjs.RunConfig(**QUICK, out=str(out))
    fjs.run(config, progress=False)
    with pytest.raises(fjs.RunError) as error:
        fjs.run(config, progress=False)
    message = str(error.value)
    assert "resume=True" in message and "overwrite=True" in message and "--" not in message, message
    code = main(["run", *QUICK_FLAGS, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--resume" in err and "--overwrite" in err and "resume=True" not in err, err


@pytest.mark.fast
def test_options_and_model_options_errors_name_the_config_fields():
    with pytest.raises(ValueError) as error:
        fjs.build(fjs.RunConfig(**QUICK, model_options={"nonsense": 1}))
    assert "RunConfig(model_options=" in str(error.value) and "--" not in str(error.value), str(error.value)
    with pytest.raises(ValueError) as error:
        fjs.build(fjs.RunConfig(**QUICK, options={"nonsense": 1}))
    assert "RunConfig(options=" in str(error.value) and "--" not in str(error.value), str(error.value)
    with pytest.raises(ValueError) as error:
        fjs.run(fjs.RunConfig(**{**QUICK, "lr": -1.0}), progress=False)
    assert str(error.value).startswith("RunConfig(lr=...) must be a positive number"), str(error.value)


@pytest.mark.fast
def test_the_cli_keeps_its_flags(capsys):
    assert main(["run", *QUICK_FLAGS, "--model-option", "nonsense=1"]) == 2
    err = capsys.readouterr().err
    assert "--model-option" in err and "RunConfig" not in err, err
    assert main(["run", *QUICK_FLAGS, "--lr", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --lr must be a positive number"), err
