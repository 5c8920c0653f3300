"""The hand-written C sources (``backends/cpu/csrc``): each ``.c`` file compiles alone, with
only the headers it includes, under the flags the backends build them with."""

from __future__ import annotations

import subprocess

import pytest

from gradtape.backends.cpu import toolchain

SOURCES = sorted(p.name for p in toolchain.CSRC.glob("*.c"))


def test_the_sources_are_found():
    assert {"ggml_vec.c", "llama_decode.c", "qgemm.c"} <= set(SOURCES)


@pytest.mark.slow  # the compiler run afresh on each file
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_alone(name, tmp_path):
    cc, _ = toolchain.compiler()
    flags = [f for f in toolchain.threads_flags() if f != "-shared"]
    res = subprocess.run([cc, *flags, f"-I{toolchain.CSRC}", "-Wall", "-Werror=implicit",
                          "-c", str(toolchain.CSRC / name), "-o", str(tmp_path / "x.o")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
