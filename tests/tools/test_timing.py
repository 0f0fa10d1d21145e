"""Machine facts recorded next to every benchmark's numbers."""
import jax
import pytest

from fedjax_sparse.tools import timing

pytestmark = pytest.mark.fast   # the whole file is in the fast tier (python -m pytest -m fast)


def test_cpuinfo_reads_the_first_cpu_only(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                 "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                 "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 85\nmodel name\t: Other\nflags\t\t: fpu\n\n")
    assert timing._cpuinfo(str(f)) == {"cpu_family": "26", "cpu_model_number": "2", "cpu_model": "AMD EPYC",
                                       "avx512f": True, "avx512_bf16": True}


def test_cpuinfo_without_the_file_is_empty(tmp_path):
    assert timing._cpuinfo(str(tmp_path / "missing")) == {}


def test_machine_facts_name_backend_and_cpu_count():
    facts = timing.machine_facts()
    assert facts["backend"] == jax.default_backend() and facts["cpu_count"] >= 1 and len(facts["load_average"]) == 3


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_peak_memory_is_the_largest_allocator_peak_in_mib():
    devices = [_Device({"peak_bytes_in_use": 3 * 2 ** 20, "bytes_in_use": 2 ** 20}),
               _Device({"peak_bytes_in_use": 5 * 2 ** 19})]
    assert timing.device_peak_memory_mib(devices) == 3.0
    assert timing.device_peak_memory_mib([_Device({"peak_bytes_in_use": 2 ** 19})]) == 0.5


def test_device_peak_memory_is_none_where_the_backend_keeps_no_statistics():
    assert timing.device_peak_memory_mib([_Device(None), _Device({"bytes_in_use": 1})]) is None
    if jax.default_backend() == "cpu":
        assert timing.device_peak_memory_mib() is None


def test_time_calls_times_every_call_after_the_first():
    calls = []
    first, times = timing.time_calls(lambda: calls.append(1) or jax.numpy.zeros(()), 3)
    assert len(calls) == 4 and len(times) == 3 and first >= 0 and min(times) >= 0
