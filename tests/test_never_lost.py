"""Never lost, round two (issue 50 item 3): what a new user met from a fresh clone, each now one line
or said once, never a traceback or a silent coercion.

* a Flax model with no parameters, and one too large for memory: refused in one line by ``from_flax``,
  the second from the weights' shapes before any weight is initialised;
* ``fjs.sweep(config, {"lr": 0.1})`` and ``seeds="01"``: refused in one line naming the fix;
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fedjax_sparse as fjs
from fedjax_sparse import memory
from fedjax_sparse.cli import main
from fedjax_sparse.errors import RunError


def one_line(err: str, needle: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


# ---------------------------------------------------------------- models
class NoParams(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.reshape(x, (x.shape[0], -1))[:, :10]


INITIALISED = []   # one entry per kernel initialisation: True when it made real (concrete) weights


def _recording_init(key, shape, dtype=jnp.float32):
    INITIALISED.append(not isinstance(key, jax.core.Tracer))
    return jnp.zeros(shape, dtype)


class Wide(nn.Module):
    """64 -> 4096 -> 10: 1.2 MiB of weights (more than the 256 KiB "device" below)."""
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(4096, kernel_init=_recording_init)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10, kernel_init=_recording_init)(x)


@pytest.mark.fast
def test_a_model_without_parameters_is_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match=r"from_flax: NoParams has no parameters"):
        fjs.models.from_flax(NoParams(), input_shape=(8, 8, 1))
    assert main(["run", "--dataset", "digits", "--model", "test_never_lost:NoParams", "--rounds", "1",
                 "--quiet"]) == 2
    one_line(capsys.readouterr().err, "has no parameters")


@pytest.mark.fast
def test_a_model_too_large_is_refused_from_its_shapes_before_any_weight_is_made(monkeypatch, capsys):
    monkeypatch.setenv(memory.LIMIT_ENV, str(256 * 1024))
    INITIALISED.clear()
    with pytest.raises(RunError, match=r"from_flax: Wide's weights take 1.2 MiB \(307,210 parameters\); "
                                       r"building and checking them holds up to 4 times that \(4.7 MiB\), "
                                       r"which exceeds the device's 256.0 KiB: use a smaller model"):
        fjs.models.from_flax(Wide(), input_shape=(8, 8, 1))
    assert INITIALISED and not any(INITIALISED), "a real weight was initialised before the refusal"
    assert main(["run", "--dataset", "digits", "--model", "test_never_lost:Wide", "--rounds", "1", "--quiet"]) == 2
    one_line(capsys.readouterr().err, "exceeds the device's 256.0 KiB")
    monkeypatch.delenv(memory.LIMIT_ENV)
    INITIALISED.clear()
    fjs.models.from_flax(Wide(), input_shape=(8, 8, 1))   # fits this machine: built, real weights checked
    assert any(INITIALISED)


# ---------------------------------------------------------------- sweeps
CONFIG = dict(dataset="digits", num_clients=4, clients_per_round=2, rounds=1)


@pytest.mark.fast
@pytest.mark.parametrize("axes, said", [
    ({"lr": 0.1}, "sweep axis 'lr' needs a list of values, got the float 0.1: write {'lr': [0.1]}"),
    ({"option.ste": "truncated"}, "sweep axis 'option.ste' needs a list of values, got the str 'truncated': "
                                  "write {'option.ste': ['truncated']}"),
    (["lr"], "a sweep's axes are a dict {key: [values]}, got a list: write e.g. {'lr': [0.01, 0.1]}"),
])
def test_a_scalar_sweep_value_is_refused_naming_the_list(axes, said):
    with pytest.raises(RunError) as e:
        fjs.sweep(fjs.RunConfig(**CONFIG), axes, progress=False)
    assert str(e.value) == said


@pytest.mark.fast
@pytest.mark.parametrize("seeds, said", [
    ("01", "seeds must be a list of integers such as [0, 1, 2], got the str '01'"),
    (3, "seeds must be a list of integers such as [0, 1, 2], got the int 3: write seeds=[3] (one seed) or "
        "seeds=range(3)"),
    ([0, 1.5], "seeds must be integers, got 1.5"),
])
def test_seeds_that_are_not_a_list_of_integers_are_refused(seeds, said, tmp_path):
    config = fjs.RunConfig(**CONFIG, out=str(tmp_path / "sweep"))
    with pytest.raises(RunError) as e:
        fjs.sweep(config, {"lr": [0.1]}, seeds=seeds, progress=False)
    assert str(e.value) == said
    assert not (tmp_path / "sweep").exists()   # refused before anything ran
    from fedjax_sparse.replicas import run_replicas
    with pytest.raises(RunError) as e:
        run_replicas(config, seeds, progress=False)
    assert str(e.value) == said
