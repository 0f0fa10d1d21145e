"""Machine facts recorded next to every benchmark's numbers."""
import jax

from fedjax_sparse import timing


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
