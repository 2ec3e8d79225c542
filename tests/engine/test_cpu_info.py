"""engine/cpu_info.py on another CPU's /proc/cpuinfo text."""

from engine import cpu_info

XEON = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
        "flags\t\t: fpu sse avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 avx_vnni\n"
        "processor\t: 1\nmodel name\t: other\n")
OLD = "model name\t: Old CPU\nflags\t\t: fpu sse avx2 fma\n"


def test_model_flags_and_bf16():
    assert cpu_info.cpu_model(XEON) == "Intel(R) Xeon(R) Platinum 8481C"
    assert {"avx512_bf16", "amx_tile"} <= cpu_info.cpu_flags(XEON)
    assert cpu_info.has_native_bf16(XEON, env={}) and not cpu_info.has_native_bf16(OLD, env={})
    # torch or oneDNN capped below AVX-512 (as vs_llamacpp.py --cpu x86-64-v3 runs): no native bf16 for torch
    for capped in ({"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ONEDNN_MAX_CPU_ISA": "avx2_vnni"}):
        assert not cpu_info.has_native_bf16(XEON, env=capped), capped
    for free in ({"ATEN_CPU_CAPABILITY": "avx512"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, {"ONEDNN_MAX_CPU_ISA": "ALL"}):
        assert cpu_info.has_native_bf16(XEON, env=free), free
    assert cpu_info.flags_line(OLD) == "fpu sse avx2 fma"
    assert cpu_info.cpu_flags("no flags here") == set()


def test_machine_lists_the_flags_that_matter_in_order():
    m = cpu_info.machine()
    assert set(m) == {"cpu_model", "cores_usable", "memory_gib", "cpu_flags"}
    assert m["cpu_flags"] == [f for f in cpu_info.FLAGS_THAT_MATTER if f in cpu_info.cpu_flags()]
    assert 1 <= m["cores_usable"] and m["memory_gib"] > 0
