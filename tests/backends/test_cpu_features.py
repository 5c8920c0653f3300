"""The C kernels follow the CPU's features, and a CPU without AVX-512 (an AVX2-only
x86-64 such as AMD Zen 3, emulated by ``pytest --cpu=avx2``: ``support/hardware.py``)
runs every test of our own kernels; only those that need oneDNN's bf16 matmul or
AVX512-BF16 instructions skip there, each saying what the CPU lacks."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from gradtape import settings
from gradtape.backends.cpu import measure as compute, ggml_vec, onednn, toolchain
from gradtape.backends.cpu.tiled import CTiles
from gradtape.errors import GradtapeError

from support.hardware import ONEDNN_PLATFORM, kernel_isa  # noqa: F401  (a fixture)

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
    # the libraries' caps come from --cpu=avx2 alone, not from a cap this run was given
    env = {k: v for k, v in os.environ.items()
           if k not in ("GRADTAPE_ISA", "ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:randomly", "--cpu=avx2", f"--junitxml={report}",
                        *PORTABLE, *NEEDS_BF16],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
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


def test_the_kernels_follow_the_isa_cap(kernel_isa):
    """Under ``$GRADTAPE_ISA`` the kernels are built for that class and ``cpu_info`` hides
    what such a CPU lacks: 8 lanes at avx2, 16 from avx512 up."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the classes are x86-64's, not {platform.machine()}'s")
    flags = compute.cpu_info()["flags"]
    if kernel_isa == "avx2":
        assert not {f for f in flags if f.startswith(("avx512", "amx"))}
        assert "-march=haswell" in toolchain.isa_flags()
    assert ggml_vec.lib().gv_lanes() == (16 if "avx512f" in flags else 8)
    assert CTiles(np.float32).lanes == (16 if "avx512f" in flags else 8)


def test_a_cap_above_the_cpu_is_an_error(monkeypatch):
    monkeypatch.setattr(toolchain, "_cpu_flags",
                        lambda: ("Zen 3", frozenset({"avx2", "fma", "f16c", "sse4_2"})))
    monkeypatch.setenv("GRADTAPE_ISA", "avx512")
    with pytest.raises(GradtapeError, match=r"\$GRADTAPE_ISA=avx512: this CPU \(Zen 3\) "
                                            r"lacks avx512f, .*use a class it has "
                                            r"\(avx2 \| native\)"):
        toolchain.isa_flags()
    monkeypatch.setenv("GRADTAPE_ISA", "AVX2")
    assert toolchain.isa() == "avx2" and toolchain.cpu_info()["model"] == \
        "Zen 3 (capped at avx2)"
    monkeypatch.setenv("GRADTAPE_ISA", "sse")
    with pytest.raises(GradtapeError, match=r"\$GRADTAPE_ISA must be one of avx2 \| avx512 "
                                            r"\| avx512bf16 \| native, got 'sse'"):
        toolchain.isa()


def test_the_cap_reaches_the_libraries_before_they_load(monkeypatch):
    """oneDNN and OpenBLAS read their caps when they load: ``import gradtape`` sets them
    first, leaving a user's own value alone."""
    for name in ("ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GRADTAPE_ISA", "avx2")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Zen")
    settings.cap_libraries()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and os.environ["OPENBLAS_CORETYPE"] == "Zen"
    code = ("import os, gradtape, numpy; print(os.environ.get('ONEDNN_MAX_CPU_ISA'), "
            "os.environ.get('OPENBLAS_CORETYPE'))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE")}
    r = subprocess.run([sys.executable, "-c", code], env={**env, "GRADTAPE_ISA": "avx512"},
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["AVX512_CORE", "SkylakeX"], r.stderr[-2000:]


def test_numpy_before_gradtape_leaves_openblas_uncapped_and_says_so():
    """OpenBLAS picks its kernels when NumPy loads it: after ``import gradtape`` they are
    the cap's (Haswell's at avx2); NumPy imported first keeps the CPU's own, with a
    warning that says how to cap it, and the measured decisions are keyed by the
    kernels that ran."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the classes are x86-64's, not {platform.machine()}'s")
    code = ("import warnings; warnings.simplefilter('always'); {first}; "
            "from gradtape.backends.cpu import blas, measure; "
            "print(blas.core(), '|', measure._blas_name())")
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE")}
    env["GRADTAPE_ISA"] = "avx2"
    runs = {}
    for first in ("import gradtape, numpy", "import numpy, gradtape"):
        r = subprocess.run([sys.executable, "-c", code.format(first=first)], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[first] = r
    capped, uncapped = runs["import gradtape, numpy"], runs["import numpy, gradtape"]
    core, name = capped.stdout.strip().split(" | ")
    assert core == "Haswell" and name.endswith("(Haswell)")
    assert "NumPy was imported before gradtape" not in capped.stderr
    assert "OPENBLAS_CORETYPE=Haswell" in uncapped.stderr
    assert "NumPy was imported before gradtape" in uncapped.stderr


def test_measured_decisions_are_kept_per_isa_class(monkeypatch, tmp_path):
    """An avx2-capped run never reuses a timing made at another class."""
    if "avx2" not in toolchain.isa_classes():
        pytest.skip("this CPU has no AVX2: only its native class exists here")
    monkeypatch.setenv("GRADTAPE_DECISIONS", str(tmp_path / "decisions.json"))
    monkeypatch.setattr(compute, "_cache_file", lambda: tmp_path / "decisions.json")
    calls = []

    def fake(*shape):
        calls.append(toolchain.isa())
        return (1.0, 2.0)
    for isa in ("native", "avx2", "native", "avx2"):
        monkeypatch.setenv("GRADTAPE_ISA", isa)
        compute.rates("test-kind", (8, 8, 8), fake)
    assert calls == ["native", "avx2"]


def test_the_cli_says_a_bad_cap_first(monkeypatch, capsys):
    from gradtape.cli.main import main

    monkeypatch.setenv("GRADTAPE_ISA", "avx1024")
    assert main(["generate", "--model", "smollm2", "--prompt", "hi"]) == 1
    assert capsys.readouterr().err.strip() == (
        "gradtape generate: error: $GRADTAPE_ISA must be one of avx2 | avx512 | avx512bf16 "
        "| native, got 'avx1024'")
