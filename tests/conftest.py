import ast
import inspect
import os
import sys
import threading
from pathlib import Path

import pytest

# Tests run on CPU, and most are compile-bound (a few rounds of many small programs): XLA:CPU's
# cheaper backend optimisation compiles about 1.6x faster (measured: tests/algorithms/test_spafl.py and
# test_feddrop.py, 222 s -> 136 s on 2 cores). Numbers are compared within a test (same flags) or with
# tolerances, never against speed. XLA:CPU's older (LLVM IR) fusion emitters compile about 1.9x faster
# again than its MLIR fusion emitters (measured: four engine tests of test_spafl, test_feddrop,
# test_fsl and test_heterofl, 33 s -> 17 s on 2 cores). With them, two programs that compute the same
# rounds (a 7-round scan against 3-round chunks) can round differently in the last bit; tests marked
# `default_emitters` check such bit-identity, and run in a child pytest with XLA's default emitters
# (pytest_pyfunc_call below). FEDJAX_SPARSE_TEST_FULL_OPT=1 keeps XLA's default optimisation and emitters.
# (The flags as the user set them, kept for child processes: pytest-xdist workers inherit ours.)
_USER_XLA_FLAGS = os.environ.setdefault("FEDJAX_SPARSE_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
_DEFAULT_EMITTERS = os.environ.get("FEDJAX_SPARSE_TEST_DEFAULT_EMITTERS") == "1"
_FLAGS = ["--xla_cpu_multi_thread_eigen=true"]
if os.environ.get("FEDJAX_SPARSE_TEST_FULL_OPT") != "1":
    _FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    if not _DEFAULT_EMITTERS:
        _FLAGS += ["--xla_cpu_use_fusion_emitters=false"]
os.environ["XLA_FLAGS"] = " ".join([_USER_XLA_FLAGS] + _FLAGS).strip()

# The CLI's persistent compilation cache is process-global: tests that call the CLI in-process would
# turn it on for every later test. Tests that check the cache pass --compile-cache themselves.
os.environ.setdefault("FEDJAX_SPARSE_COMPILE_CACHE", "off")

# Many tests compile the same programs (the same tiny engines, models and shapes, built afresh per
# test, so JAX's in-memory cache misses): JAX's persistent compilation cache, in a folder of this
# session's own, hands a program compiled once to every later test and to the subprocesses the tests
# start (notebook kernels, CLI runs; they inherit the variables). A program is reused only for the
# identical program, XLA flags and versions, so no number changes. Measured on 2 cores, the default suite
# in two workers: 333 s without it, 311-314 s with it. FEDJAX_SPARSE_TEST_COMPILE_CACHE=off compiles
# afresh everywhere.
_TEST_CACHE = None
if os.environ.get("FEDJAX_SPARSE_TEST_COMPILE_CACHE", "on") != "off" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _TEST_CACHE = tempfile.mkdtemp(prefix="fedjax_sparse_test_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _TEST_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    import atexit
    import shutil

    atexit.register(shutil.rmtree, _TEST_CACHE, ignore_errors=True)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `default_emitters` runs in a child pytest compiled with XLA:CPU's default fusion
    emitters (see the flags above); its failure output is this test's."""
    if pyfuncitem.get_closest_marker("default_emitters") is None or _DEFAULT_EMITTERS \
            or os.environ.get("FEDJAX_SPARSE_TEST_FULL_OPT") == "1":
        return None
    import subprocess
    config = pyfuncitem.config
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "default_emitters",
               pyfuncitem.nodeid]
    if config.pluginmanager.hasplugin("xdist"):
        command[4:4] = ["-n", "0"]
    env = dict(os.environ, XLA_FLAGS=_USER_XLA_FLAGS, FEDJAX_SPARSE_TEST_DEFAULT_EMITTERS="1")
    child = subprocess.run(command, cwd=config.rootpath, env=env, capture_output=True, text=True, timeout=1200)
    if child.returncode != 0:
        pytest.fail(f"{pyfuncitem.nodeid}, run with XLA's default fusion emitters in a child pytest (exit code "
                    f"{child.returncode}):\n{child.stdout[-8000:]}\n{child.stderr[-2000:]}", pytrace=False)
    return True


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "fashion_mnist").is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA}")
    return SHARED_DATA


# ---------------------------------------------------------------------------- the fast tier
# `python -m pytest -m fast` (tests marked `fast`) is the inner loop: under a minute on 2 cores, and it
# must exercise every module of the package. A session that runs the whole tier (no paths but tests/,
# no -k) fails, naming the modules, when a module was never imported, or when none of the functions it
# defines ran (its module-level code alone does not count). Calls are seen by a trace function on
# function entry only (it returns None: no line events), installed only in `-m fast` sessions; under
# pytest-xdist each worker sends what it saw to the controller, which checks the union.
PACKAGE = Path(__file__).resolve().parents[1] / "fedjax_sparse"
_IN_PACKAGE = os.sep + "fedjax_sparse" + os.sep
_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
_BODIES: set[str] = set()   # files whose module body ran (imported)
_CALLED: set[str] = set()   # files one of whose functions or methods ran
_WORKER_KEY = "fedjax_sparse_fast_tier"


def _trace_calls(frame, event, arg, _in=_IN_PACKAGE, _local=inspect.CO_NEWLOCALS, _skip=_COMPREHENSIONS,
                 _bodies=_BODIES, _called=_CALLED):   # (bound names: threads may call it during shutdown)
    code = frame.f_code
    if _in in code.co_filename:
        if code.co_flags & _local:   # a function call (not a module or class body)
            if code.co_name not in _skip:
                _called.add(code.co_filename)
        elif code.co_name == "<module>":
            _bodies.add(code.co_filename)
    return None


def _fast_session(config) -> bool:
    return (config.getoption("markexpr") or "").strip() == "fast"


def _whole_fast_tier(config) -> bool:
    tests = Path(__file__).resolve().parent
    paths = {Path(str(a).split("::")[0]).resolve() for a in config.args}
    return _fast_session(config) and not config.getoption("keyword") and paths <= {tests}


def pytest_configure(config):
    if _fast_session(config):
        threading.settrace(_trace_calls)
        sys.settrace(_trace_calls)


def _seen() -> dict[str, list[str]]:
    loaded = {getattr(m, "__file__", None) for n, m in list(sys.modules.items())
              if n == "fedjax_sparse" or n.startswith("fedjax_sparse.")}
    return {"imported": sorted(_BODIES | {f for f in loaded if f}), "called": sorted(_CALLED)}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):   # pytest-xdist: a worker finished; merge what it saw
    seen = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
    if seen:
        _BODIES.update(seen["imported"])
        _CALLED.update(seen["called"])


def _defines_functions(path: Path) -> bool:
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
               for n in ast.walk(ast.parse(path.read_text())))


def fast_tier_gaps(imported, called) -> list[str]:
    """The package modules that a fast-tier session did not import, or whose functions never ran."""
    imported = {os.path.realpath(f) for f in imported}
    called = {os.path.realpath(f) for f in called}
    gaps = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE.parent).as_posix()
        if os.path.realpath(path) not in imported:
            gaps.append(f"{name}: never imported")
        elif os.path.realpath(path) not in called and _defines_functions(path):
            gaps.append(f"{name}: imported, but none of its functions ran")
    return gaps


_FAST_TIER_GAPS: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not _fast_session(config):
        return
    sys.settrace(None)
    threading.settrace(None)
    if hasattr(config, "workerinput"):   # a pytest-xdist worker: the controller checks
        config.workeroutput[_WORKER_KEY] = _seen()
        return
    if exitstatus != pytest.ExitCode.OK or not _whole_fast_tier(config):
        return
    seen = _seen()
    _FAST_TIER_GAPS[:] = fast_tier_gaps(seen["imported"], seen["called"])
    if _FAST_TIER_GAPS:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _FAST_TIER_GAPS:
        terminalreporter.section("fast tier: modules not exercised", sep="=", red=True, bold=True)
        for gap in _FAST_TIER_GAPS:
            terminalreporter.line(gap, red=True)
        terminalreporter.line("Mark a test that exercises each with @pytest.mark.fast (tests/conftest.py).", red=True)
