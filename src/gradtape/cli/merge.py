"""Fold a LoRA adapter into its base model and write the merged model.

--format hf (the default) writes a Hugging Face folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template, generation_config.json)
that transformers' AutoModelForCausalLM.from_pretrained and gradtape load.  --format gguf
writes one llama-architecture GGUF file (float32 or float16) for llama.cpp, transformers
(gguf_file=) and gradtape; --out is then the file (a name ending in .gguf) or a folder to
put model.gguf in.  An --out ending in .gguf implies --format gguf.

examples:
  gradtape merge --model smollm2 --adapter runs/chat/adapter --out merged/
  gradtape merge --model smollm2 --adapter runs/chat/adapter --out merged.gguf --dtype float16
"""

from __future__ import annotations

from pathlib import Path

from ..errors import GradtapeError


def add_arguments(p):
    p.add_argument("--model", default="smollm2", metavar="NAME|PATH",
                   help="the base model: 'smollm2' (default), a .gguf file, or a Hugging "
                        "Face model folder")
    p.add_argument("--adapter", required=True, metavar="DIR",
                   help="the LoRA adapter folder (PEFT format), e.g. from 'gradtape finetune'")
    p.add_argument("--out", required=True, metavar="FOLDER|FILE.gguf",
                   help="where to write: a folder (hf), or a .gguf file or folder (gguf)")
    p.add_argument("--format", choices=("hf", "gguf"), default=None,
                   help="hf: Hugging Face folder; gguf: one GGUF file (default: gguf when "
                        "--out ends in .gguf, else hf)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                   help="precision of the written weights (default float32)")


def run(args) -> int:
    from ..blocks import is_block_matrix
    from ..models import load
    from ..models.export import save_gguf, save_hf_folder
    from ..models.lora import check_adapter_fits, load_adapter

    out = Path(args.out).expanduser()
    fmt = args.format or ("gguf" if out.suffix.lower() == ".gguf" else "hf")
    if fmt == "hf" and out.suffix.lower() == ".gguf":
        raise GradtapeError(f"--out {out}: --format hf writes a folder, not a .gguf file")
    if fmt == "hf" and out.exists() and not out.is_dir():
        raise GradtapeError(f"--out {out}: exists and is not a folder")
    # the base stays in its stored type; each tensor is dequantized, merged and written
    # on its own, so an 8B base needs its file's size in memory, not a float32 copy
    model = load(args.model, keep_quantized=True)
    adapter = load_adapter(args.adapter, model)
    check_adapter_fits(adapter, model.config, "adapter")
    kinds = sorted({w.qtype for w in model.weights.values() if is_block_matrix(w)}
                   - {"F16" if args.dtype == "float16" else "F32"})
    note = (f"; the base's {'/'.join(kinds)} weights are written dequantized to {args.dtype} "
            "(merging back into quantized blocks is not done)") if kinds else ""
    if fmt == "hf":
        save_hf_folder(model, out, args.dtype, adapter=adapter)
        print(f"wrote {out}/ (Hugging Face folder, {args.dtype}, {model.config.n_layers} "
              f"layers, adapter rank {adapter.rank} folded in{note})")
    else:
        if out.suffix.lower() != ".gguf":
            if out.exists() and not out.is_dir():
                raise GradtapeError(f"--out {out}: give a .gguf file name or a folder")
            out.mkdir(parents=True, exist_ok=True)
            out = out / "model.gguf"
        elif not out.parent.is_dir():
            raise GradtapeError(f"--out {out}: folder {out.parent} does not exist")
        save_gguf(model, out, args.dtype, adapter=adapter)
        print(f"wrote {out} (GGUF, {args.dtype}, adapter rank {adapter.rank} folded in{note})")
    return 0
