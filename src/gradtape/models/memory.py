"""How much memory a model's weights take, read from the file's header before loading,
and how much the machine has free (``/proc/meminfo``'s MemAvailable).

``weight_bytes(path)`` sums, per tensor, what loading makes resident: float32 copies
(``n_elements * 4``), or with ``keep_quantized`` the stored bytes of every matrix a
``BlockMatrix`` keeps (the mapped file's pages; q/k also as a permuted copy) and float32
for the rest.  Nothing is dequantized or allocated here; the headers are read with the
validating readers.  ``keep_stored`` decides ``--weights`` (finetune, generate) from
those figures.  What a training step adds on top is ``train.memory``'s business.
"""

from __future__ import annotations

from pathlib import Path

from ..blocks import BLOCK_TYPES, is_block_matrix
from .. import settings
from ..errors import FileFormatError, GradtapeError

GiB = float(1 << 30)
# --weights: float32 copies, the file's own blocks, or float32 where it leaves room
WEIGHT_MODES = ("auto", "float32", "stored")
# auto keeps float32 copies only where they (and the overhead) take at most this share
# of the memory available: the rest is the run's own (activations, optimizer, KV cache)
FLOAT32_SHARE = 0.8


def mem_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or None
    where unknown.  ``$GRADTAPE_MEM_AVAILABLE`` (bytes) overrides it (tests)."""
    forced = settings.integer("GRADTAPE_MEM_AVAILABLE", minimum=0)
    if forced is not None:
        return forced
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def weight_bytes(path, keep_quantized=False) -> int:
    """Resident bytes of the weights ``models.load(path, keep_quantized=...)`` makes."""
    path = Path(path)
    if path.is_dir():
        return _hf_bytes(path, keep_quantized)
    if path.is_file():
        return _gguf_bytes(path, keep_quantized)
    raise FileFormatError(f"{path}: no such file or folder")


def _gguf_bytes(path, keep):
    from ..formats.gguf_reader import GGUFFile

    total = 0
    for name, t in GGUFFile(path).tensors.items():
        n = t.n_elements
        if keep and len(t.shape) == 2 and t.tensor_type.name in BLOCK_TYPES:
            total += t.nbytes
            if name.endswith(("attn_q.weight", "attn_k.weight")):
                total += t.nbytes  # rows permuted into a copy
        else:
            total += 4 * n
    return total


def _hf_bytes(folder, keep):
    from ..formats.safetensors_reader import read_header
    from .load_hf import _tensor_files

    total = 0
    for f in _tensor_files(folder):
        entries = read_header(f)[0]
        for dt, shape, (lo, hi) in entries.values():
            n = 1
            for d in shape:
                n *= d
            total += (hi - lo) if keep and dt in ("BF16", "F16") and len(shape) == 2 else 4 * n
    return total


def resident_bytes(weights) -> int:
    """Bytes of a loaded weights dict (float arrays and block matrices)."""
    return sum(int(w.nbytes) for w in weights.values())


def keep_stored(weights, path, available, log, name, overhead, ignore_memory=False) -> bool:
    """Whether to load ``path``'s matrices in their stored type (``models.load``'s
    ``keep_quantized``) for ``--weights`` = ``weights`` (one of WEIGHT_MODES): stored,
    yes; float32, no, but refused before loading where the float32 copy (plus
    ``overhead`` bytes) exceeds ``available`` (unless ``ignore_memory``); auto, float32
    unless that copy leaves under a fifth of ``available``, then stored, said through
    ``log``.  ``name``: the model as the user named it, for the messages."""
    if weights == "stored":
        return True
    f32 = weight_bytes(path, keep_quantized=False)
    if available is None or f32 + overhead <= FLOAT32_SHARE * available:
        return False
    if weights == "auto":
        log(f"weights: the float32 copy would take {f32 / GiB:.1f} GiB of the "
            f"{available / GiB:.1f} GiB available; keeping them in their stored type")
        return True
    if f32 + overhead > available and not ignore_memory:
        kept = weight_bytes(path, keep_quantized=True)
        raise GradtapeError(f"not enough memory: the float32 weights of {name} take "
                            f"{f32 / GiB:.1f} GiB, more than the {available / GiB:.1f} GiB "
                            f"available; --weights stored keeps them in the file's type "
                            f"({kept / GiB:.1f} GiB)")
    return False


def resident_copy_bytes(weights) -> int:
    """Bytes of bf16 copies of ``weights``' block matrices (2 a value), those a bf16
    step may keep (``plan.resident_weights``); a BF16 matrix is read where it lies."""
    return sum(2 * w.shape[0] * w.shape[1] for w in weights.values()
               if is_block_matrix(w) and w.qtype != "BF16")
