"""Generate text with a LLaMA-family model, optionally with a LoRA adapter.

Tokens are printed as they are produced.  Greedy decoding at --temperature 0 (the
default); otherwise temperature and nucleus (--top-p) sampling, reproducible with
--seed.  Generation stops at the model's end-of-sequence token or --max-new-tokens.

examples:
  gradtape generate --prompt "The capital of France is"
  gradtape generate --chat --prompt "Give me three tips for sleeping well."
  gradtape generate --model ./my-llama-folder --adapter ./out --prompt "..." --temperature 0.7
"""

from __future__ import annotations

import sys

import numpy as np

from ..errors import GradtapeError


def add_arguments(p):
    p.add_argument("--model", default="smollm2", metavar="NAME|PATH",
                   help="'smollm2' (the embedded SmolLM2-135M-Instruct, default), a .gguf "
                        "file, or a Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--prompt", required=True, metavar="TEXT",
                   help="the text to continue (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template, "
                        "with the assistant's turn opened")
    p.add_argument("--adapter", metavar="DIR", default=None,
                   help="a LoRA adapter folder (PEFT format: adapter_config.json + "
                        "adapter_model.safetensors), e.g. from 'gradtape finetune'")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="the most tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="X",
                   help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with total "
                        "probability >= P (default 1.0 = off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="arithmetic precision (default float32)")
    p.add_argument("--compute", choices=("float32", "bf16", "auto"), default="float32",
                   help="precision of the frozen-weight GEMMs (default float32; generation "
                        "runs float32 for now: bf16 says so and runs float32)")


class StreamPrinter:
    """Prints tokens as text as they arrive.  Decodes the whole tail since the last
    printed character, so a multi-byte character split over tokens prints once it is
    complete (an incomplete one decodes to U+FFFD and is held back)."""

    def __init__(self, tokenizer, out=None, skip=()):
        self.tok, self.out, self.skip = tokenizer, out or sys.stdout, frozenset(skip)
        self.ids, self.printed = [], 0

    def __call__(self, token_id):
        if token_id in self.skip:  # the end-of-sequence token is not part of the text
            return
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return  # wait for the rest of the character
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def finish(self):
        text = self.tok.decode(self.ids)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def run(args) -> int:
    from ..models import load

    if args.max_new_tokens < 1:
        raise GradtapeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise GradtapeError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise GradtapeError(f"--top-p must be in (0, 1], got {args.top_p}")
    model = load(args.model)
    tok = model.tokenizer
    if tok is None:
        raise GradtapeError(f"{args.model}: the model has no tokenizer (no tokenizer.json)")
    adapter = None
    if args.adapter:
        from ..models.lora import load_adapter
        adapter = load_adapter(args.adapter, model)
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                       add_generation_prompt=True)
    ids = tok.encode(text)
    if not ids:
        raise GradtapeError("the prompt encodes to no tokens")
    ctx = model.config.max_seq_len
    if len(ids) + args.max_new_tokens > ctx:
        raise GradtapeError(
            f"the prompt ({len(ids)} tokens) plus --max-new-tokens {args.max_new_tokens} is "
            f"longer than the model's context ({ctx} tokens)"
            + ("; shorten the prompt" if len(ids) >= ctx else
               f"; use --max-new-tokens {ctx - len(ids)} or less"))
    printer = StreamPrinter(tok, skip=model.stop_ids)
    model.generate(ids, args.max_new_tokens, temperature=args.temperature, adapter=adapter,
                   seed=args.seed, top_p=args.top_p, stream=printer,
                   dtype=np.dtype(args.dtype), compute=args.compute)
    printer.finish()
    return 0
