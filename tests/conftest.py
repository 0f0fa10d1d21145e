import os
from pathlib import Path

import pytest

# Tests run on CPU, and most are compile-bound (a few rounds of many small programs): XLA:CPU's
# cheaper backend optimisation compiles about 1.6x faster (measured: tests/test_spafl.py and
# test_feddrop.py, 222 s -> 136 s on 2 cores). Numbers are compared within a test (same flags) or with
# tolerances, never against speed. FEDJAX_SPARSE_TEST_FULL_OPT=1 keeps XLA's default optimisation.
_FLAGS = ["--xla_cpu_multi_thread_eigen=true"]
if os.environ.get("FEDJAX_SPARSE_TEST_FULL_OPT") != "1":
    _FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + _FLAGS).strip()

# The CLI's persistent compilation cache is process-global: tests that call the CLI in-process would
# turn it on for every later test. Tests that check the cache pass --compile-cache themselves.
os.environ.setdefault("FEDJAX_SPARSE_COMPILE_CACHE", "off")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "fashion_mnist").is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA}")
    return SHARED_DATA
