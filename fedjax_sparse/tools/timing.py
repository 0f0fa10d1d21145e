"""Wall-clock timing of engine rounds and the machine facts recorded beside it (for benchmark scripts;
tests never time)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from fedjax_sparse.core.memory import device_peak_memory_mib  # noqa: F401  (a tool reads it too)


def time_rounds(engine, state, data, rounds: int):
    """Runs one round (compiles), then ``rounds`` more, each jitted alone and
    synchronised. Returns (state, seconds of the first round including
    compilation, [rounds] seconds of the others, the last round's metrics)."""
    last = [state, None]

    def one_round():
        last[:] = engine.round_fn(last[0], data)
        return last[0]
    first, times = time_calls(one_round, rounds)
    return last[0], first, times, last[1]


def time_calls(fn, repeats: int) -> tuple[float, list[float]]:
    """Calls ``fn()`` once (it compiles), then ``repeats`` more times, each synchronised. Returns
    (seconds of the first call, [repeats] seconds of the others)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, times


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict:
    """Model name, family, model number and AVX-512 flags of the first CPU in ``path`` (Linux's
    /proc/cpuinfo; {} where there is none)."""
    fields = {"model name": "cpu_model", "cpu family": "cpu_family", "model": "cpu_model_number", "flags": "flags"}
    found: dict = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in fields and fields[key] not in found:
                    found[fields[key]] = value.strip()
                if not line.strip() and found:
                    break
    except OSError:
        return {}
    flags = found.pop("flags", "").split()
    return {**found, **{flag: flag in flags for flag in ("avx512f", "avx512_bf16")}}


def machine_facts() -> dict:
    """What a timing depends on: CPU model and count, load, backend, devices, versions. Timings
    from different CPUs are not comparable (this project's 2-core machine has changed host, and
    the matmul ceiling doubled with it), so every benchmark JSON records this next to its
    numbers."""
    return {"cpu_count": os.cpu_count(), **_cpuinfo(), "machine": platform.machine(),
            "load_average": list(os.getloadavg()), "backend": jax.default_backend(),
            "devices": [d.device_kind for d in jax.devices()], "jax": jax.__version__,
            "python": platform.python_version()}


# Distributions whose versions a device timing depends on (JAX's CUDA/ROCm plugins come under these names).
SOFTWARE = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
            "jax-rocm60-plugin", "flax", "optax", "numpy")


def source_hash(root: str | Path | None = None) -> str:
    """sha256 (first 16 hex digits) over the package's ``*.py`` files (path and content, sorted): which
    code a timing measured, also where the checkout travels without its git history."""
    base = Path(root) if root is not None else Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(base.rglob("*.py")):
        digest.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def software_facts() -> dict:
    """The versions a timing depends on (installed distributions of :data:`SOFTWARE`; absent ones left
    out), the backend's platform version (e.g. the CUDA runtime a GPU plugin reports) and the
    package's :func:`source_hash`."""
    versions = {}
    for name in SOFTWARE:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        platform_version = jax.devices()[0].client.platform_version
    except Exception:   # noqa: BLE001 - a backend without the attribute: the versions still stand
        platform_version = None
    return {"versions": versions, "platform_version": platform_version, "source_hash": source_hash()}


def product_gflops(m: int, k: int, n: int, dtype=jnp.float32, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of one jitted [m, k] @ [k, n] with ``dtype`` operands and
    float32 results on the default device."""
    a = jax.random.normal(jax.random.PRNGKey(0), (m, k)).astype(dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (k, n)).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    _, times = time_calls(lambda: f(a, b), repeats)
    return 2 * m * k * n / min(times, default=float("inf")) / 1e9


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a float32 [n, n] @ [n, n] (``product_gflops``): the practical ceiling that
    achieved GFLOP/s figures are read against."""
    return product_gflops(n, n, n, jnp.float32, repeats)
