"""Errors in the words of the caller (issue 42 item 3): messages are written once, naming flags; the
API's entry points (``fjs.run``, ``fjs.sweep``, ``fjs.build``, ``fjs.data.load``, ``make_model``)
rewrite them into the Python arguments that set them (``errors.python_words``), the CLI keeps its
flags (``errors.cli_caller``)."""
import ast
import re
from pathlib import Path

import pytest

import fedjax_sparse as fjs
from fedjax_sparse.cli import RUN_FLAGS, main
from fedjax_sparse.errors import python_words

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
    """Every message a ``raise X(...)`` in the package writes that names a run flag (f-string
    fields as ``X``), with its file and line."""
    for path in sorted(SOURCE.rglob("*.py")):
        if path.name == "cli.py":   # the command line's own errors are read on the command line only
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            parts = []
            for arg in ast.walk(node.exc.args[0]):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    parts.append(arg.value)
                elif isinstance(arg, ast.FormattedValue):
                    parts.append("X")
            text = "".join(parts)
            if LEFT.search(text):
                yield f"{path.relative_to(SOURCE)}:{node.lineno}", text


@pytest.mark.fast
def test_every_error_that_names_a_flag_has_python_words():
    messages = list(raised_messages())
    assert len(messages) > 60   # the scan finds them (config, runner, checkpoint, sweeps, data, models...)
    for where, text in messages:
        assert not LEFT.search(python_words(text)), (where, text, python_words(text))


@pytest.mark.fast
def test_python_words_spell_the_arguments():
    cases = {
        "pass --resume with a larger --rounds to extend it, --overwrite to replace it, or choose another --out":
            "pass resume=True with a larger RunConfig(rounds=...) to extend it, overwrite=True to replace it, or "
            "choose another RunConfig(out=...)",
        "--lr must be a positive number": "RunConfig(lr=...) must be a positive number",
        "use --client-state device": "use RunConfig(execution=Execution(client_state='device'))",
        "add --option init=model": "add RunConfig(options={'init': 'model'})",
        "unknown --model-option foo for model x": "unknown RunConfig(model_options=...) foo for model x",
        "e.g. --sweep lr=0.01,0.1": "e.g. axes={'lr': [0.01, 0.1]}",
        "give the seeds with --seeds 0 1 2 (every point)": "give the seeds with seeds=[0, 1, 2] (every point)",
        "continue with: python -m fedjax_sparse run --out /tmp/x --resume":
            "continue with: fjs.run(config, resume=True) with config.out='/tmp/x'",
        "--partition-file /a/b.json partitions": "RunConfig(partition_file='/a/b.json') partitions",
        "choose another --json FILE": "choose another --json FILE",   # bench's own flag: not a run's
    }
    for cli, python in cases.items():
        assert python_words(cli) == python, cli
    assert python_words("drop --download", {"--download": "download=True"}) == "drop download=True"


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
