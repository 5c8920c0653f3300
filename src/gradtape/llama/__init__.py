"""gradtape.llama: the public LLaMA API (SPEC.md section 3): ``load``, ``Llama``,
``load_adapter``.

``Llama`` (``facade``) is a loaded model with ``logits`` and ``generate``; the code lives
in ``gradtape.models`` (loading, the graph, LoRA, export), ``gradtape.infer`` (logits and
generation) and ``gradtape.train`` (fine-tuning).  This package holds only the facade and
re-exports the public names.
"""

from ..models import DEFAULT_MODEL, LlamaConfig, default_model_path
from ..models.graph import record_forward, weight_consts
from ..models.lora import load_adapter
from .facade import Llama, load

__all__ = ["load", "Llama", "LlamaConfig", "record_forward", "weight_consts", "load_adapter",
           "default_model_path", "DEFAULT_MODEL"]
