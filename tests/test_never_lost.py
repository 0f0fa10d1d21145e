"""Never lost, round two (issue 50 item 3): what a new user met from a fresh clone, each now one line
or said once, never a traceback or a silent coercion.

* a Flax model with no parameters, and one too large for memory: refused in one line by ``from_flax``,
  the second from the weights' shapes before any weight is initialised;
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
