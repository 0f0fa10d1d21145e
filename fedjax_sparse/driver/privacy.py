"""Privacy accounting of client-level DP-FedAvg (``algorithms.private.with_dp``) with Google's
``dp_accounting``: epsilon of a run, epsilon after every round, and the noise multiplier for a
target epsilon. The unit of privacy is a client; one round releases the sum of the sampled clients'
updates, each clipped to L2 norm C, plus N(0, (z C)^2) noise per coordinate.

* ``sampling="without_replacement"`` (fixed K of N, the engine's default): REPLACE-ONE adjacency,
  sensitivity 2C, so the event carries ``GaussianDpEvent(z / 2)`` (dp_accounting's bound reads its
  parameter as std / sensitivity; ``tests/algorithms/test_privacy.py`` pins that). RDP only.
* ``sampling="poisson"`` (``--client-sampling poisson``, q = K / N): ADD-OR-REMOVE-ONE adjacency,
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``; RDP or PLD (on the ``PLD_VALUE_INTERVAL`` grid,
  pessimistic, so epsilon stays an upper bound).

A pinned cohort schedule or ``resample_every`` > 1 breaks the independent per-round sampling these
events assume. Conventions, the PLD grid and the measured speed: docs/privacy.md, "Accounting".
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Callable

import dp_accounting
import numpy as np
from dp_accounting import mechanism_calibration
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

SAMPLINGS = ("without_replacement", "poisson")
ACCOUNTANTS = ("rdp", "pld")
# The privacy-loss grid of the PLD accountant (dp_accounting's default: 1e-4). Pessimistic at any
# interval (an upper bound on epsilon); this one is checked against 1e-4 in tests/algorithms/test_privacy.py.
PLD_VALUE_INTERVAL = 1e-3
NeighborRel = dp_accounting.NeighboringRelation
# dp_accounting's default RDP orders (1.1 ... 10.9 in 0.1 steps, 11 ... 63, 128, 256, 512, 1024).
DEFAULT_ORDERS = tuple(float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS)


@contextlib.contextmanager
def _quiet():
    """dp_accounting's "failed to converge ... Excluding this order" records (absl's logger) dropped for the
    duration: the order is left out of the minimum, which keeps epsilon an upper bound; nothing to do."""
    def drop(record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()
    logger = logging.getLogger("absl")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _check(num_clients: int, clients_per_round: int, sampling: str, noise_multiplier: float) -> None:
    neighboring_relation(sampling)   # refuses an unknown sampling
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(f"clients_per_round ({clients_per_round}) must be between 1 and num_clients ({num_clients})")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")


def neighboring_relation(sampling: str) -> dp_accounting.NeighboringRelation:
    """The adjacency of ``sampling``'s guarantee: REPLACE_ONE client (without replacement) or
    ADD_OR_REMOVE_ONE client (Poisson)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"unknown sampling {sampling!r}; valid: {', '.join(SAMPLINGS)}")
    return NeighborRel.REPLACE_ONE if sampling == "without_replacement" else NeighborRel.ADD_OR_REMOVE_ONE


def round_event(noise_multiplier: float, *, num_clients: int, clients_per_round: int,
                sampling: str = "without_replacement") -> dp_accounting.DpEvent:
    """One round's DpEvent (module docstring): K of N without replacement with ``GaussianDpEvent(z / 2)``
    (replace-one sensitivity 2C), or Poisson with q = K / N and ``GaussianDpEvent(z)``."""
    _check(num_clients, clients_per_round, sampling, noise_multiplier)
    if sampling == "without_replacement":
        return dp_accounting.SampledWithoutReplacementDpEvent(
            num_clients, clients_per_round, dp_accounting.GaussianDpEvent(noise_multiplier / 2))
    return dp_accounting.PoissonSampledDpEvent(clients_per_round / num_clients,
                                               dp_accounting.GaussianDpEvent(noise_multiplier))


def dp_event(noise_multiplier: float, rounds: int, *, num_clients: int, clients_per_round: int,
             sampling: str = "without_replacement") -> dp_accounting.DpEvent:
    """The run's DpEvent: ``rounds`` independent rounds of ``round_event``."""
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    return dp_accounting.SelfComposedDpEvent(
        round_event(noise_multiplier, num_clients=num_clients, clients_per_round=clients_per_round,
                    sampling=sampling), int(rounds))


def make_accountant(sampling: str = "without_replacement", accountant: str = "rdp",
                    orders: tuple[float, ...] = DEFAULT_ORDERS) -> dp_accounting.PrivacyAccountant:
    """A fresh dp_accounting accountant for ``sampling``'s events: RDP (at ``orders``) or PLD (Poisson only)."""
    relation = neighboring_relation(sampling)
    if accountant == "rdp":
        return rdp_lib.RdpAccountant(list(orders), neighboring_relation=relation)
    if accountant == "pld":
        if sampling != "poisson":
            raise ValueError("dp_accounting's PLD accountant does not support sampling without replacement "
                             "(SampledWithoutReplacementDpEvent); use accountant='rdp', or sampling='poisson'")
        return dp_accounting.pld.PLDAccountant(relation, value_discretization_interval=PLD_VALUE_INTERVAL)
    raise ValueError(f"unknown accountant {accountant!r}; valid: {', '.join(ACCOUNTANTS)}")


def epsilon(noise_multiplier: float, rounds: int, delta: float, *, num_clients: int, clients_per_round: int,
            sampling: str = "without_replacement", accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds (``accountant``: "rdp" or "pld", the latter for
    Poisson sampling only, on the ``PLD_VALUE_INTERVAL`` grid). ``noise_multiplier == 0`` (no noise)
    gives inf; 0 rounds give 0. Cached: the same arguments cost nothing the second time."""
    return _epsilon(float(noise_multiplier), int(rounds), float(delta), int(num_clients), int(clients_per_round),
                    sampling, accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon(noise_multiplier: float, rounds: int, delta: float, num_clients: int, clients_per_round: int,
             sampling: str, accountant: str) -> float:
    event = dp_event(noise_multiplier, rounds, num_clients=num_clients, clients_per_round=clients_per_round,
                     sampling=sampling)
    fresh = make_accountant(sampling, accountant)
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    if accountant == "pld":
        # What PLDAccountant.compose(event).get_epsilon(delta) computes (tested), from one round's PLD built once.
        return float(_round_pld(noise_multiplier, clients_per_round / num_clients).self_compose(rounds)
                     .get_epsilon_for_delta(delta))
    with _quiet():
        return float(fresh.compose(event).get_epsilon(delta))


@functools.lru_cache(maxsize=64)
def _round_pld(noise_multiplier: float, sampling_prob: float):
    """One Poisson-sampled Gaussian round's PLD (add-or-remove adjacency) on the ``PLD_VALUE_INTERVAL`` grid:
    what ``PLDAccountant`` builds for ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``."""
    return dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, value_discretization_interval=PLD_VALUE_INTERVAL,
        sampling_prob=sampling_prob, neighboring_relation=NeighborRel.ADD_OR_REMOVE_ONE)


def round_rdp(noise_multiplier: float, *, num_clients: int, clients_per_round: int,
              sampling: str = "without_replacement", orders: tuple[float, ...] = DEFAULT_ORDERS) -> np.ndarray:
    """[len(orders)] float64: one round's RDP at ``orders`` (inf everywhere when z == 0; an order where
    dp_accounting's series does not converge is inf, so it is never the minimiser)."""
    event = round_event(noise_multiplier, num_clients=num_clients, clients_per_round=clients_per_round,
                        sampling=sampling)
    if noise_multiplier == 0:
        return np.full(len(orders), np.inf)
    with _quiet():
        return np.asarray(make_accountant(sampling, "rdp", orders).compose(event).rdp, np.float64)


def rdp_to_epsilon(orders, rdp, delta: float) -> np.ndarray:
    """RDP [..., A] at ``orders`` [A] -> epsilon [...] at ``delta``: dp_accounting's conversion
    (``rdp_privacy_accountant.compute_epsilon``: Canonne, Kamath, Steinke 2020, Prop. 12 / Asoodeh
    et al. 2020, with the KL bound for tiny RDP) vectorised over the leading axes, minimised over the
    orders."""
    orders = np.asarray(orders, np.float64)
    rdp = np.asarray(rdp, np.float64)
    if delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    if np.any(orders < 1):
        raise ValueError("RDP orders must be >= 1")
    if delta == 0:
        return np.where(np.all(rdp == 0, axis=-1), 0.0, np.inf)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        bound = rdp + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1)
        eps = np.where(orders > 1.01, bound, np.inf)
        # Tiny RDP: the KL bound delta <= sqrt(1 - exp(-rdp)) already holds at epsilon 0.
        eps = np.where(delta**2 + np.expm1(-rdp) > 0, 0.0, eps)
        # Negative RDP (numerical trouble in extreme events): dp_accounting returns 0 there too.
        eps = np.where(rdp < 0, 0.0, eps)
    return np.maximum(0.0, np.min(eps, axis=-1))


def epsilon_curve(noise_multiplier: float, rounds: int, delta: float, *, num_clients: int, clients_per_round: int,
                  sampling: str = "without_replacement", orders: tuple[float, ...] = DEFAULT_ORDERS) -> np.ndarray:
    """[rounds] float64: RDP epsilon at ``delta`` after rounds 1, 2, ..., ``rounds`` (entry r - 1 is
    ``epsilon(z, r, delta, accountant="rdp")``): one accountant call for one round's RDP, scaled by r."""
    one = round_rdp(noise_multiplier, num_clients=num_clients, clients_per_round=clients_per_round,
                    sampling=sampling, orders=orders)
    # What RdpAccountant.compose(SelfComposedDpEvent(event, r)) computes: 0 + r * rdp, bit for bit.
    counts = np.arange(1, int(rounds) + 1, dtype=np.float64)[:, None]
    return rdp_to_epsilon(orders, counts * one[None], delta)


def epsilon_by_round(noise_multiplier: float, rounds: int, delta: float, *, num_clients: int,
                     clients_per_round: int, sampling: str = "without_replacement",
                     accountant: str = "rdp") -> Callable[[int], float]:
    """round r -> epsilon at ``delta`` after min(r, ``rounds``) rounds, by ``accountant``: what a run's
    metrics rows say. RDP: ``epsilon_curve``, computed once; PLD: ``epsilon`` per asked round (cached)."""
    if accountant == "rdp":
        curve = epsilon_curve(noise_multiplier, rounds, delta, num_clients=num_clients,
                              clients_per_round=clients_per_round, sampling=sampling)
        return lambda r: float(curve[min(int(r), len(curve)) - 1])
    make_accountant(sampling, accountant)   # refuses an unknown accountant, or PLD without Poisson sampling, now
    return lambda r: epsilon(noise_multiplier, min(int(r), int(rounds)), delta, num_clients=num_clients,
                             clients_per_round=clients_per_round, sampling=sampling, accountant=accountant)


def calibrate_noise_multiplier(target_epsilon: float, rounds: int, delta: float, *, num_clients: int,
                               clients_per_round: int, sampling: str = "without_replacement",
                               accountant: str = "rdp", tol: float = 1e-4) -> float:
    """The smallest noise multiplier z (within ``tol``) whose ``epsilon(z, rounds, delta, ...)`` is at
    most ``target_epsilon``: dp_accounting's ``calibrate_dp_mechanism`` (Brent's method, then a
    bisection that guarantees epsilon <= target) on a bracket found by doubling / halving from 1.
    Cached (a sweep's seeds calibrate once)."""
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return _calibrate(float(target_epsilon), int(rounds), float(delta), int(num_clients), int(clients_per_round),
                      sampling, accountant, float(tol))


@functools.lru_cache(maxsize=256)
def _calibrate(target_epsilon: float, rounds: int, delta: float, num_clients: int, clients_per_round: int,
               sampling: str, accountant: str, tol: float) -> float:
    def eps(z: float) -> float:
        return epsilon(z, rounds, delta, num_clients=num_clients, clients_per_round=clients_per_round,
                       sampling=sampling, accountant=accountant)

    low, high = 0.5, 1.0
    while eps(high) > target_epsilon:
        low, high = high, 2 * high
        if high > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon {target_epsilon} at delta {delta}")
    while eps(low) <= target_epsilon:
        low, high = low / 2, low
        if low < 1e-6:
            return high   # epsilon <= target already with (almost) no noise
    with _quiet():
        return float(mechanism_calibration.calibrate_dp_mechanism(
            lambda: make_accountant(sampling, accountant),
            lambda z: dp_event(z, rounds, num_clients=num_clients, clients_per_round=clients_per_round,
                               sampling=sampling),
            target_epsilon, delta, mechanism_calibration.ExplicitBracketInterval(low, high), tol=tol))


__all__ = ["ACCOUNTANTS", "DEFAULT_ORDERS", "PLD_VALUE_INTERVAL", "SAMPLINGS", "calibrate_noise_multiplier",
           "dp_event", "epsilon", "epsilon_by_round", "epsilon_curve", "make_accountant", "neighboring_relation",
           "rdp_to_epsilon", "round_event", "round_rdp"]
