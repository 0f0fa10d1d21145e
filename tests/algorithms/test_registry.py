"""Typed algorithm options: CLI strings coerced to the field types of the algorithm's frozen dataclass,
unknown keys and wrong types refused with one line naming --option. (That every algorithm has one:
tests/algorithms/test_every_algorithm.py.)"""

import pytest

from fedjax_sparse.algorithms import resolve_options

pytestmark = pytest.mark.fast   # the whole file is in the fast tier (python -m pytest -m fast)


def test_cli_strings_and_json_values_are_coerced_to_the_field_types():
    options = resolve_options("fedavg", {"momentum": "0.9", "weighted": "false", "server_lr": 1})
    assert options.momentum == 0.9 and options.weighted is False
    assert options.server_lr == 1.0 and isinstance(options.server_lr, float)
    fsl = resolve_options("fsl", {"attacker_clients": "7", "mask_by": "raw"})
    assert fsl.attacker_clients == 7 and fsl.mask_by == "raw"
    assert resolve_options("fsl", fsl) is fsl


@pytest.mark.parametrize("options, message", [
    ({"bogus": "1"}, "unknown option(s) ['bogus'] for algorithm 'fedavg' (--option KEY=VALUE)"),
    ({"momentum": "fast"}, "--option momentum='fast' of algorithm fedavg: expected a number"),
    ({"weighted": "maybe"}, "--option weighted='maybe' of algorithm fedavg: expected a boolean"),
    ({"weighted": 1}, "expected a boolean"),
    ({"momentum": [0.9]}, "expected a number"),
    ({"momentum": True}, "expected a number"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ValueError) as info:
        resolve_options("fedavg", options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_integer_options_refuse_fractions():
    with pytest.raises(ValueError, match="expected an integer"):
        resolve_options("fsl", {"attacker_clients": "2.5"})
