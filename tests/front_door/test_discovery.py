"""Discovery and small consistencies (issue 42 item 6): one version everywhere, ``run --help`` in
argument groups with examples, the docs opening with a copyable example, ``report`` naming the density it
shows. (``list`` describing each algorithm and model: tests/algorithms/test_every_algorithm.py.)"""
import argparse
import re
from importlib.metadata import version
from pathlib import Path

import pytest

import fedjax_sparse as fjs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.fast
def test_one_version_in_the_package_its_metadata_pyproject_and_the_changelog():
    declared = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    top = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert fjs.__version__ == version("fedjax_sparse") == declared == top


@pytest.mark.fast
def test_report_shows_and_names_the_density_the_runs_own_table_shows(tmp_path):
    """The issue's case: report showed 0.695 (over all clients) where the run printed 0.679 (sampled)."""
    from fedjax_sparse.driver.progress import format_summary
    from helpers import fake_run
    row = {"round": 5, "accuracy": 0.5, "density": 0.679, "density_all_clients": 0.695}
    run = fake_run(tmp_path / "spafl", {"algorithm": "spafl", "rounds": 5}, [row])
    table = fjs.report_table([run])
    header, _, line = table.splitlines()
    assert "density (sampled clients)" in header and "0.679" in line and "0.695" not in line, table
    summary = {"algorithm": "spafl", "dataset": "d", "model": "m", "rounds": 5, "final_accuracy": 0.5,
               "final_accuracy_std": None, "final_global_accuracy": None, "best_accuracy": 0.5, "best_round": 5,
               "final_density": 0.679, "total_gbit": None, "total_flops": None, "seconds": 1.0,
               "first_chunk_seconds_incl_compile": 1.0}
    assert "density (sampled clients)" in format_summary(summary) and "0.679" in format_summary(summary)


def _help(capsys, *command) -> str:
    from fedjax_sparse.cli import main
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    return capsys.readouterr().out


@pytest.mark.fast
def test_run_help_is_in_argument_groups_with_examples_at_the_end(capsys):
    from fedjax_sparse.cli import RUN_EXAMPLES, _parser
    from fedjax_sparse.driver.settings import GROUPS, RUN_FLAGS
    text = _help(capsys, "run")
    sections = re.split(r"\n\n(?=[a-z][a-z ]*:\n)", text)
    titles = [section.split(":\n")[0] for section in sections[1:]]
    assert titles == ["options", *GROUPS, "examples"], titles
    assert sections[1].count("\n  -") == 1   # "options" holds -h alone: every flag is in its group
    for flag, *_, group in RUN_FLAGS:   # every setting's flag names one of the groups
        assert group in GROUPS, flag
    assert text.rstrip().endswith(RUN_EXAMPLES.splitlines()[-1].strip())
    for line in RUN_EXAMPLES.replace("\\\n", "").splitlines()[1:]:   # every example parses
        argv = line.split("#")[0].split()[3:]
        _parser().parse_args(argv)


@pytest.mark.fast
@pytest.mark.parametrize("doc", ["sweeps.md", "privacy.md"])
def test_the_sweeps_and_privacy_docs_open_with_a_copyable_example(doc):
    from fedjax_sparse.cli import _parser
    text = (ROOT / "docs" / doc).read_text()
    opening = text.split("\n## ")[0]
    shell = re.search(r"```bash\n(.*?)```", opening, re.S).group(1).replace("\\\n", "")
    for line in shell.splitlines():
        assert line.startswith("python -m fedjax_sparse ")
        _parser().parse_args(line.split("#")[0].split()[3:])
    code = re.search(r"```python\n(.*?)```", opening, re.S).group(1)
    compile(code, doc, "exec")
    assert text.index("```bash") < 400   # the first thing after the title


# Every flag of `run` and `bench` with its help group and kind, as the hand-kept tables made them (0.2.0,
# with --dataset-option): the CLI generated from the settings' field metadata keeps each (issue 49 item 2).
RUN_FLAGS_AND_GROUPS = """
--config configuration store --setting configuration store --dataset data str --data-dir data str --num-clients data int
--partition data str --min-client-samples data int --preprocess data str --partition-file data str
--dataset-option data append --download data storetrue --model model str --init-params model str
--model-option model append --algorithm algorithm str --clients-per-round algorithm int --client-sampling algorithm str
--resample-every algorithm int --rounds algorithm int --local-epochs algorithm int --batch-size algorithm int
--lr algorithm float --seed algorithm int --cohort-schedule algorithm str --option algorithm append
--dp-clip privacy float --dp-noise-multiplier privacy float --dp-target-epsilon privacy float --dp-delta privacy float
--dp-accountant privacy str --aggregator robustness str --trim-fraction robustness float --attack robustness str
--malicious-fraction robustness float --max-chunk-seconds execution float --client-parallelism execution str
--eval-batch-size execution int --personal-eval execution str --client-state execution str
--client-storage execution str --host-chunk-rounds execution int --eval-every outputs int --checkpoint-every outputs int
--checkpoint-seconds outputs float --out outputs str --log outputs str"""
RUN_ONLY = """--seeds seeds_and_sweeps int --replica-parallelism seeds_and_sweeps store --sweep seeds_and_sweeps append
--sweep-select seeds_and_sweeps store --compile-cache execution store --coordinator execution store
--num-processes execution int --process-id execution int --resume outputs storetrue --change outputs append
--overwrite outputs storetrue --quiet outputs storetrue"""
BENCH_ONLY = """--rounds-timed options int --compare options append --json options store --overwrite options storetrue
--isolate options storetrue --matmul-size options int --quiet options storetrue --count-kernels options storetrue
--compile-cache options store"""


def _flags_of(command: str) -> set[tuple[str, str, str]]:
    from fedjax_sparse.cli import _parser
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = set()
    for group in sub.choices[command]._action_groups:
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or "--help" in action.option_strings:
                continue
            assert action.help, action.option_strings   # every flag says what it does
            kind = getattr(action.type, "__name__", None) or type(action).__name__.strip("_").replace("Action", "")
            found |= {(flag, group.title.replace(" ", "_"), kind.lower()) for flag in action.option_strings}
    return found


@pytest.mark.fast
def test_run_and_bench_keep_every_flag_in_its_group():
    def rows(text):
        words = text.split()
        return {tuple(words[i:i + 3]) for i in range(0, len(words), 3)}
    assert _flags_of("run") == rows(RUN_FLAGS_AND_GROUPS + " " + RUN_ONLY)
    assert _flags_of("bench") == rows(RUN_FLAGS_AND_GROUPS + " " + BENCH_ONLY)
