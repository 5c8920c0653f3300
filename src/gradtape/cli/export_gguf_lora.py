"""Write a LoRA adapter as a llama.cpp LoRA GGUF (the format llama.cpp's
convert_lora_to_gguf.py writes), to use with llama.cpp's --lora next to the base GGUF.

The base model (--model) supplies the shapes to check and the head counts: llama.cpp
stores the rows of attn_q/attn_k in its interleaved rope order, and the adapter's
lora_b for q and k is permuted the same way.  A DoRA adapter has no such form (no
magnitudes in llama.cpp's LoRA): it is refused, naming `gradtape merge`, which folds it in.

example:
  gradtape export-gguf-lora --adapter runs/chat/adapter --model smollm2 --out chat-lora.gguf
  llama-cli -m SmolLM2-135M-Instruct.gguf --lora chat-lora.gguf -p "..."
"""

from __future__ import annotations

from .. import checks
from .options import adapter_folder


def add_arguments(p):
    p.add_argument("--adapter", required=True, metavar="DIR",
                   help="the LoRA adapter folder (PEFT format), e.g. from 'gradtape finetune'")
    p.add_argument("--model", default="smollm2", metavar="NAME|PATH",
                   help="the base model the adapter was trained on: 'smollm2' (default), a "
                        ".gguf file, or a Hugging Face model folder")
    p.add_argument("--out", required=True, metavar="FILE.gguf", help="the GGUF file to write")
    p.add_argument("--outtype", choices=("f32", "f16"), default="f32",
                   help="tensor type of lora_a / lora_b (default f32)")


def run(args) -> int:
    from ..models import load
    from ..models.export import refuse_dora, save_gguf_lora
    from ..models.lora import check_adapter_fits, load_adapter

    # the paths and the adapter before the model is loaded: a mistake costs seconds
    out = checks.output_file(args.out, "--out")
    adapter_dir = adapter_folder(args.adapter)
    adapter = load_adapter(adapter_dir)
    refuse_dora(adapter, f"--adapter {adapter_dir}")
    model = load(args.model)
    check_adapter_fits(adapter, model.config, str(adapter_dir))
    save_gguf_lora(adapter, model.config, out, args.outtype,
                   name=adapter_dir.resolve().name)
    print(f"wrote {out} (llama.cpp LoRA, rank {adapter.rank}, alpha "
          f"{adapter.scale * adapter.rank:g}, {len(adapter.weights)} adapted linears)")
    return 0
