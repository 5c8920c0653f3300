"""Full fine-tuning (``--fine-tune-type full``): every weight of the model is trained.

What sets it apart from LoRA lives here: the parameters (every weight a float32 param,
a GGUF's blocks dequantized; norms and embeddings too, as transformers' full fine-tuning
trains every parameter; a tied LM head reads the embedding param, so it stays tied), the
memory check made from the file's header before the weights are loaded (weights,
gradients and AdamW's two moments), and the output (the trained model as a Hugging Face
folder, a GGUF on request, through the writers ``gradtape merge`` has).  The step itself
is ``train.step.TrainStep``'s, the same graph with params where LoRA has consts.  Not
here: the loop, checkpoints (``train.finetune``), the graph (``models.graph``).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from ..blocks import is_block_matrix
from ..errors import GradtapeError
from ..models.export import dense, save_gguf, save_hf_folder
from ..models.lora import ADAPTER_TYPES
from ..models.memory import GiB, weight_bytes

FINE_TUNE_TYPES = ADAPTER_TYPES + ("full",)  # the adapters (models.lora), or every weight

# how a full step's weight products run under bf16 compute (the plan's trained_bf16):
# a trained weight changes every step, so its bf16 copy is made again each step
BF16_WHY = ("each rounded to bf16 before its products (the largest by its update, the "
            "others into one scratch), its products and gradient with bf16 inputs and "
            "float32 sums, as under torch's autocast")

# logits from which a full step's LM head and loss are the fused primitive (as the
# preference log-probabilities', models.graph.LOGPS_FUSE_MIN): the composed head keeps
# the [N, V] logits' gradient alive until the trained table's gradient (x^T dlogits) is
# made, which then lives beside it; the fused one makes that gradient from h and the
# table, both alive anyway, so it runs last (compile.sink) and nothing [N, V] exists
HEAD_FUSE_FROM = 1 << 22
# ... its logits blocks of this many elements (a quarter of tiled.HEAD_BUDGET): the
# block's scratch (logits, bf16 table rows and products: about 11 bytes an element) is
# kept beside the whole state, and narrower blocks cost the head's GEMMs little
HEAD_BUDGET = 1 << 21

# copies of each weight a full step holds outside its activations' arena: the param and
# AdamW's two moments (the step program keeps them in the tape's own arrays and writes
# their new values there); the eval program reads the step's params, checkpoints and the
# model are written one array at a time (gradient accumulation adds the accumulator)
STEP_COPIES = 3
# and what the header check counts per weight: those, the model's own copy and the gradient
STATE_COPIES = STEP_COPIES + 2


def weight_params(tp, model) -> dict:
    """``{name: tp.param}`` of every weight of ``model`` (our names and orientation), in
    the tape's dtype; a block matrix (a weight kept in its stored type) is dequantized.
    Each in C order, as the step program keeps its params: a program reading a weight
    in C kernels (bf16 compute's conversion) takes no copy of its own before it shares
    the step's (a GGUF's matrices arrive transposed).  A block matrix's mapped pages are
    released once it is dequantized (``BlockMatrix.release``)."""
    out = {}
    for name, w in model.weights.items():
        out[name] = tp.param(np.ascontiguousarray(dense(model.weights, name)))
        if is_block_matrix(w):  # its mapped pages are not read again by the step
            w.release()
    return out


def trained_model(model, weights):
    """A model of ``model``'s class with the trained ``weights`` (a mapping of float32
    arrays, such as ``TrainStep.model_weights``, read when the writers ask)."""
    if dataclasses.is_dataclass(model):
        return dataclasses.replace(model, weights=weights)
    out = copy.copy(model)  # a record of another kind with the same fields
    out.weights = weights
    return out


def check_fits(path, available, name, overhead, ignore_memory=False, itemsize=4,
               early_stop=False):
    """Refuse, from the file's header alone, a model whose full fine-tuning cannot fit:
    its weights, their params, gradients and two AdamW moments (``STATE_COPIES`` values
    each, ``itemsize`` bytes; ``early_stop``: one more, the best evaluation's) and
    ``overhead`` bytes above ``available`` (None: unknown)."""
    if available is None or ignore_memory:
        return
    n = weight_bytes(path, keep_quantized=False) // 4
    copies = STATE_COPIES + int(early_stop)
    need = n * itemsize * copies + overhead
    if need > available:
        raise GradtapeError(
            f"not enough memory: full fine-tuning of {name} ({n / 1e6:.0f}M weights) needs "
            f"about {need / GiB:.1f} GiB before its activations (each weight {copies} "
            f"times: the model's, the step's params, gradients and 2 AdamW moments"
            + (", the best evaluation's for --early-stop" if early_stop else "") + "), "
            f"but only {available / GiB:.1f} GiB is available; --fine-tune-type lora trains "
            "a small adapter instead (or --ignore-memory to try anyway)")


def save_model(model, out, gguf_dtype=""):
    """Write the trained ``model`` into the run folder ``out``: ``model/`` (a Hugging Face
    folder: config.json, model.safetensors, the tokenizer's files), and with
    ``gguf_dtype`` (float32 or float16) ``model.gguf`` too; returns what it wrote, in
    words."""
    folder = save_hf_folder(model, out / "model", "float32")
    what = f"model in {folder}"
    if gguf_dtype:
        path = save_gguf(model, out / "model.gguf", gguf_dtype)
        what += f" and {path} ({gguf_dtype})"
    return what
