"""gradtape.llama: the public names of the LLaMA application (``load``, ``load_adapter``), kept for users' imports.

The code lives in ``gradtape.models`` (loading, the graph, LoRA, export) and
``gradtape.train`` (fine-tuning); this module only re-exports it.
"""

from ..models import DEFAULT_MODEL, Llama, LlamaConfig, default_model_path, load, record_forward, weight_consts
from ..models.lora import load_adapter

__all__ = ["load", "Llama", "LlamaConfig", "record_forward", "weight_consts", "load_adapter",
           "default_model_path", "DEFAULT_MODEL"]
