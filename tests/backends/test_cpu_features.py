"""The C kernels follow the CPU's features, and a CPU without AVX-512 (an AVX2-only
x86-64 such as AMD Zen 3, emulated by ``pytest --cpu=avx2``: ``support/hardware.py``)
runs every test of our own kernels; only those that need oneDNN's bf16 matmul or
AVX512-BF16 instructions skip there, each saying what the CPU lacks."""

from __future__ import annotations

import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from gradtape.backends.cpu import measure as compute, ggml_vec, onednn
from gradtape.backends.cpu.tiled import CTiles

from support.hardware import ONEDNN_PLATFORM

REPO = Path(__file__).resolve().parents[2]

# our own C kernels, each with a portable path: they run on every x86-64
PORTABLE = [
    "tests/backends/test_bf16_compute.py::test_c_conversion_matches_host_bitwise",
    "tests/backends/test_qgemm.py::test_bf16_tiles_are_the_rounded_reference",
    "tests/backends/test_qgemm.py::test_blocked_tile_is_the_plain_rows_rearranged",
    "tests/backends/test_qgemm.py::test_int8_tiles_are_the_quantized_reference",
    "tests/backends/test_qgemm.py::test_plain_halves_every_bit_pattern",
    "tests/backends/test_cpu_kernels.py::test_bf16_fused_attention_adds_the_remainder_of_every_"
    "large_p",
    "tests/backends/test_cpu_kernels.py::test_fused_attention_backward_is_the_same_in_every_call",
    "tests/backends/test_cpu_kernels.py::test_onednn_head_gemms_equal_numpys",
    "tests/backends/test_ggml_vec.py",
    "tests/backends/test_wide_vectors.py::test_bf16_fused_attention_on_16_lanes",
    "tests/backends/test_cpu_features.py::test_the_kernels_lanes_follow_the_cpus_flags",
]
# what needs oneDNN's bf16 matmul (AVX-512 or AMX) or AVX512-BF16 itself
NEEDS_BF16 = {
    "tests/backends/test_bf16_compute.py::test_onednn_gemm_is_bf16_inputs_float32_accumulation":
        "this CPU has no oneDNN bf16 matmul (it needs AVX-512 or AMX)",
    "tests/backends/test_cpu_kernels.py::test_bf16_head_gemms_are_within_bf16_rounding":
        "this CPU has no oneDNN bf16 matmul (it needs AVX-512 or AMX)",
    "tests/backends/test_wide_vectors.py::test_bf16_instructions_equal_their_plain_c_block":
        "no AVX512-BF16 on this CPU",
}


def test_the_kernels_lanes_follow_the_cpus_flags():
    """16 float lanes where ``cpu_info`` says AVX-512, else 8 (AVX2); oneDNN's bf16 matmul
    and the AVX512-BF16 block only where the CPU has the instructions."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the kernels' lanes are x86-64's (AVX2 / AVX-512), not "
                    f"{platform.machine()}'s")
    flags = compute.cpu_info()["flags"]
    lanes = 16 if "avx512f" in flags else 8
    assert ggml_vec.lib().gv_lanes() == lanes
    assert CTiles(np.float32).lanes == lanes
    assert CTiles(np.float32, True).bf16_native == ("avx512_bf16" in flags)
    if ONEDNN_PLATFORM:
        assert onednn.available()[0] == ("avx512f" in flags)


@pytest.mark.slow  # a pytest of its own, its kernels built for another CPU
def test_an_avx2_cpu_skips_only_what_needs_bf16_instructions(tmp_path):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"emulates an x86-64 CPU: this is {platform.machine()}")
    report = tmp_path / "report.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:randomly", "--cpu=avx2", f"--junitxml={report}",
                        *PORTABLE, *NEEDS_BF16],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and report.is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    outcome = {}  # test function's node id -> [(passed | skipped, skip message), ...]
    for case in ET.parse(report).iter("testcase"):
        node = (case.get("classname").replace(".", "/") + ".py::"
                + case.get("name").split("[")[0])
        skipped = case.find("skipped")
        outcome.setdefault(node, []).append(
            ("passed", "") if skipped is None else ("skipped", skipped.get("message")))
    for want in PORTABLE:
        ran = [o for n, os_ in outcome.items() if n.startswith(want) for o in os_]
        assert ran and all(k == "passed" for k, _ in ran), (want, ran)
    for want, reason in NEEDS_BF16.items():
        ran = outcome.get(want)
        assert ran and all(k == "skipped" and reason in msg for k, msg in ran), (want, ran)
