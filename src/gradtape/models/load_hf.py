"""Loading a Hugging Face model folder of any family in ``models.arch``: config.json,
safetensors weights, tokenizer.json.

Weights come from ``model.safetensors`` or the shards a ``model.safetensors.index.json``
lists, read by a small safetensors parser (header JSON + memory map) that checks every
dtype, shape and byte range before use and understands bfloat16 (which NumPy lacks).
Nothing is unpickled: a folder with only ``pytorch_model.bin`` is refused.  Tensors are
renamed to ours by the family's name map and linears transposed to ``[in, out]``; a
tensor the family does not have is refused by name; a tied LM head is left out
(``tok_embd`` serves), an untied one is kept as ``lm_head [V, D]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..blocks import BlockMatrix
from ..errors import FileFormatError
from ..formats.safetensors_reader import read_header, read_safetensors as _read_checked
from .arch import ARCHS, LINEARS
from .config import LlamaConfig, from_hf_config
from .tokenizer import Tokenizer

_LINEARS = set(LINEARS)


def read_safetensors(path: Path) -> dict:
    """``{name: float32 array}`` from one safetensors file (F32, F64, F16, BF16), every
    dtype, shape and byte range checked first (``formats.safetensors_reader``)."""
    return _read_checked(path, float32=True)[0]


def _read(path: Path, keep_quantized):
    """``(name, tensor)`` pairs of one safetensors file: float32 arrays, or with
    ``keep_quantized`` a ``BlockMatrix`` view of every 2-d BF16 / F16 tensor."""
    if not keep_quantized:
        return read_safetensors(path).items()
    entries, _, _, buf = read_header(path)
    halves = {n for n, (dt, shape, _) in entries.items() if dt in ("BF16", "F16")
              and len(shape) == 2}
    out = {n: BlockMatrix(entries[n][0], entries[n][1],
                          np.asarray(buf[entries[n][2][0]:entries[n][2][1]]).reshape(
                              entries[n][1][0], 2 * entries[n][1][1]))
           for n in halves}
    out.update(_read_checked(path, float32=True, skip=halves)[0])
    return out.items()


def _same_tensor(a, b):
    if isinstance(a, BlockMatrix) or isinstance(b, BlockMatrix):
        return (isinstance(a, BlockMatrix) and isinstance(b, BlockMatrix)
                and a.qtype == b.qtype and np.array_equal(a.data, b.data))
    return np.array_equal(a, b)


def _read_json(path: Path):
    """A JSON object from ``path``; anything else is a ``FileFormatError``."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FileFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise FileFormatError(f"{path}: not a JSON object")
    return obj


def _tensor_files(folder: Path) -> list[Path]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise FileFormatError(f"{index}: no weight_map")
        files = []
        bad = [s for s in wm.values() if not isinstance(s, str) or Path(s).name != s]
        if bad:
            raise FileFormatError(f"{index}: shard {bad[0]!r} is not a file name")
        for shard in dict.fromkeys(wm.values()):
            p = folder / shard
            if not p.is_file():
                raise FileFormatError(f"{index}: shard {shard!r} is missing")
            files.append(p)
        return files
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise FileFormatError(f"{folder}: only pickled PyTorch weights (*.bin/*.pt) found; "
                              "gradtape reads safetensors only (never unpickles)")
    raise FileFormatError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _our_name(hf, block):
    """Our name of the Hugging Face tensor ``hf``; ``block``: the family's per-layer map
    (``models.arch``).  ``None`` for a tensor we do not know."""
    name = hf[len("model."):] if hf.startswith("model.") else hf
    if name == "embed_tokens.weight":
        return "tok_embd"
    if name == "norm.weight":
        return "norm"
    if hf == "lm_head.weight":
        return "lm_head"
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "layers" and parts[1].isascii() and parts[1].isdigit():
        sub = ".".join(parts[2:])
        if sub in block:
            return f"layers.{int(parts[1])}.{block[sub]}"
    return None


def _text_tower(hf, arch):
    """The language-model name of tensor ``hf`` of a multimodal checkpoint
    (``model.language_model.layers.0...`` -> ``model.layers.0...``), ``""`` for a
    tensor of its vision tower or projector (not loaded: images are no input here), or
    ``hf`` unchanged."""
    for prefix in arch.text_prefixes:
        if hf.startswith(prefix):
            return "model." + hf[len(prefix):]
    if not arch.text_prefixes:
        return hf
    top = hf[len("model."):] if hf.startswith("model.") else hf
    if top.split(".", 1)[0] in ("vision_tower", "multi_modal_projector"):
        return ""
    return "lm_head.weight" if hf == "language_model.lm_head.weight" else hf


def load_hf_folder(folder, keep_quantized=False) -> tuple[LlamaConfig, dict,
                                                          Tokenizer | None, str]:
    """``(config, weights, tokenizer or None, name)`` from a Hugging Face model folder.

    ``keep_quantized``: bf16 / f16 matrices stay 2 bytes per value, as ``BlockMatrix``
    views (qtype BF16 / F16) of the memory-mapped file in torch's ``[out, in]``."""
    folder = Path(folder)
    cj_path = folder / "config.json"
    try:
        cfg = from_hf_config(_read_json(cj_path), str(cj_path))
    except (AttributeError, TypeError, OverflowError) as e:  # a field of the wrong JSON type
        raise FileFormatError(f"{cj_path}: malformed ({type(e).__name__}: {e})") from None
    expected = cfg.weight_shapes()
    arch = ARCHS[cfg.arch]
    block = arch.hf_block
    weights = {}
    lm_head = None
    for f in _tensor_files(folder):
        for hf, arr in _read(f, keep_quantized):
            hf = _text_tower(hf, arch)
            if not hf:
                continue
            ours = _our_name(hf, block)
            if ours is None:
                if hf.endswith("rotary_emb.inv_freq"):
                    continue  # a cache some old checkpoints saved; we compute rope ourselves
                raise FileFormatError(f"{f}: unexpected tensor {hf} for a {cfg.arch} model "
                                      "(a part gradtape does not implement)")
            if ours == "lm_head" and cfg.tie_embeddings:
                lm_head = arr  # a tied head saved anyway: must equal the embedding
                continue
            if ours not in expected:
                raise FileFormatError(f"{f}: tensor {hf} does not fit the config "
                                      f"({cfg.arch}, {cfg.n_layers} layers, "
                                      f"tied={cfg.tie_embeddings})")
            want = expected[ours]
            base = ours.rsplit(".", 1)[-1]
            stored = tuple(reversed(want)) if base in _LINEARS else want
            if tuple(arr.shape) != stored:
                raise FileFormatError(f"{f}: tensor {hf} has shape {list(arr.shape)}, "
                                      f"expected {list(stored)} from config.json")
            if isinstance(arr, BlockMatrix):  # stays [out, in] (tok_embd: [V, D]) as stored
                weights[ours] = arr
                continue
            weights[ours] = np.ascontiguousarray(arr.T if base in _LINEARS else arr,
                                                 dtype=np.float32)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise FileFormatError(f"{folder}: missing weights for {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if lm_head is not None and not _same_tensor(lm_head, weights["tok_embd"]):
        raise FileFormatError(f"{folder}: config.json says tie_word_embeddings but "
                              "lm_head.weight differs from embed_tokens.weight")
    try:
        tok = Tokenizer.from_hf_folder(folder, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    except (FileFormatError, MemoryError, RecursionError):
        raise
    except Exception as e:  # tokenizers raises plain Exceptions; a JSON field of the wrong type
        raise FileFormatError(f"{folder}: malformed tokenizer files ({type(e).__name__}: "
                              f"{e})") from None
    return cfg, weights, tok, folder.resolve().name
