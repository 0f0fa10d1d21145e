"""The README's quickstart shows each system working (issue 50 item 4): its SpaFL and FedAvg commands,
read from README.md and run as written, print the density, accuracy and Gbit the README states.

Density and accuracy come from 30 rounds of float training: another CPU (its vector width, XLA's
choices) may round differently, so they are held to 0.02 and 2 points; bits are exact counts."""
import re
import shlex
from pathlib import Path

import pytest

from fedjax_sparse.cli import main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def readme_command(setting: str) -> tuple[list[str], float, float]:
    """(the command's arguments after ``python -m fedjax_sparse``, the density and the accuracy its
    comment states)."""
    lines = [line for line in README.splitlines()
             if line.startswith("python -m fedjax_sparse run ") and f"--setting {setting} " in line]
    assert len(lines) == 1, f"the README's quickstart has no single `--setting {setting}` command: {lines}"
    command, comment = lines[0].split("#", 1)
    stated = re.search(r"density ([0-9.]+), accuracy ([0-9.]+) %", comment)
    assert stated, comment
    return shlex.split(command)[3:], float(stated.group(1)), float(stated.group(2))


def printed(out: str, label: str) -> float:
    match = re.search(rf"^{re.escape(label)}\s*\| ([0-9.]+)", out, re.MULTILINE)
    assert match, out
    return float(match.group(1))


@pytest.mark.parametrize("setting", ["spafl_digits", "spafl_digits_fedavg"])
def test_the_readme_quickstart_prints_what_the_readme_says(setting, tmp_path, monkeypatch, capsys):
    args, density, accuracy = readme_command(setting)
    monkeypatch.chdir(tmp_path)   # its --out runs/... lands here
    assert main(args) == 0
    out = capsys.readouterr().out
    assert abs(printed(out, "density (sampled clients)") - density) <= 0.02, out
    assert abs(printed(out, "final accuracy (personalised, mean ± std)") - accuracy) <= 2.0, out
    gbit = re.search(r"sends ([0-9.]+) Gbit to FedAvg's ([0-9.]+) at about the same accuracy", README)
    assert gbit, "the README's sentence under the quickstart"
    spafl_gbit, fedavg_gbit = gbit.groups()
    if setting == "spafl_digits":
        assert density < 0.8   # it prunes visibly: the point of the quickstart
        assert f"{printed(out, 'communication (up + down)'):.4f}" == spafl_gbit
    else:
        assert density == 1.0
        assert f"{printed(out, 'communication (up + down)'):.2f}" == fedavg_gbit
