import os
from pathlib import Path

import pytest

# Tests run on CPU; keep XLA from grabbing every core's worth of threads per process.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "fashion_mnist").is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA}")
    return SHARED_DATA
