"""Generate text with a LLaMA-family model, optionally with a LoRA adapter.

Tokens are printed as they are produced.  Greedy decoding at --temperature 0 (the
default); otherwise sampling (--top-k, --top-p, --min-p; --repetition-penalty applies to
greedy too), reproducible with --seed.  Generation stops at the model's end-of-sequence
token, at a --stop string (not printed), or after --max-new-tokens.

With --chat and no --prompt: an interactive chat in the terminal (or over piped lines);
the conversation is kept and sent through the model's chat template each turn; Ctrl-D
(end of input) leaves, Ctrl-C stops the current answer.

examples:
  gradtape generate --prompt "The capital of France is"
  gradtape generate --chat --prompt "Give me three tips for sleeping well."
  gradtape generate --chat --adapter runs/mine/adapter       # interactive
  gradtape generate --model ./my-llama-folder --adapter ./out --prompt "..." --temperature 0.7
"""

from __future__ import annotations

import sys

import numpy as np

from .. import checks
from ..plan import COMPUTE_CHOICES
from ..errors import GradtapeError
from ..infer.loop import check_stop_strings, cut_at_stop, held_back
from ..infer.sampling import Sampling
from ..models.memory import WEIGHT_MODES, keep_stored, mem_available
from .options import adapter_folder


def add_arguments(p):
    p.add_argument("--model", default="smollm2", metavar="NAME|PATH",
                   help="'smollm2' (the embedded SmolLM2-135M-Instruct, default), a .gguf "
                        "file, or a Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="the text to continue (with --chat: the user's message; --chat "
                        "without --prompt starts an interactive chat)")
    p.add_argument("--chat", action="store_true",
                   help="use the model's chat template: the prompt is a user message and "
                        "the assistant's turn is opened")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: a system message (default: the template's own)")
    p.add_argument("--adapter", metavar="DIR", default=None,
                   help="a LoRA adapter folder (PEFT format: adapter_config.json + "
                        "adapter_model.safetensors), e.g. from 'gradtape finetune'")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="the most tokens to generate (default 64; 512 per answer in an "
                        "interactive chat)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="X",
                   help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K most likely tokens only (default 0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with total "
                        "probability >= P (default 1.0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="keep tokens at least P times as likely as the most likely one "
                        "(default 0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide the positive logits of tokens already seen by R (multiply "
                        "the negative ones); 1 = off (default), 1.1-1.3 is typical")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the output contains TEXT (not printed); repeatable")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="arithmetic precision (default float32)")
    p.add_argument("--weights", choices=WEIGHT_MODES, default="auto",
                   help="frozen weights: stored (kept in the file's own type -- Q4_K, "
                        "Q8_0, bf16 ... -- memory-mapped, as llama.cpp runs them) or "
                        "float32 (a dequantized copy, refused where it does not fit); "
                        "auto (default) is stored: each token's C step reads the stored "
                        "blocks either way, so a copy would only cost memory and time")
    p.add_argument("--compute", choices=COMPUTE_CHOICES, default="auto",
                   help="precision of the prompt's GEMMs: auto (default) runs a long "
                        "prompt as one compiled bf16 program where this CPU's bf16 GEMMs "
                        "are faster than float32 row by row, else float32; bf16 asks "
                        "for it on any prompt. New tokens are decoded as llama.cpp "
                        "does: 8-bit input rows, integer sums, a float16 KV cache "
                        "($GRADTAPE_DECODE_DOTS=float: float32 rows and cache)")


class StreamPrinter:
    """Prints tokens as text as they arrive.  Decodes the whole tail since the last
    printed character, so a multi-byte character split over tokens prints once it is
    complete (an incomplete one decodes to U+FFFD and is held back); text that may be
    the start of a stop string is held back too, and nothing from a stop string on is
    printed.  ``finish()`` ends the line and returns the text."""

    def __init__(self, tokenizer, out=None, skip=(), stop=()):
        self.tok, self.out, self.skip = tokenizer, out or sys.stdout, frozenset(skip)
        self.stop = tuple(stop)
        self.ids, self.printed, self.stopped = [], 0, False

    def _visible(self, text):
        cut, found = cut_at_stop(text, self.stop)
        if found:
            self.stopped = True
            return cut
        return text[:len(text) - held_back(text, self.stop)]

    def __call__(self, token_id):
        if token_id in self.skip or self.stopped:  # the end-of-sequence token is no text
            return
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return  # wait for the rest of the character
        text = self._visible(text)
        if len(text) > self.printed:
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)

    def finish(self) -> str:
        text = cut_at_stop(self.tok.decode(self.ids), self.stop)[0]
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()
        return text


def _sampling(args) -> dict:
    """The sampling keywords of ``Llama.generate``, checked (by the model API's own
    checks) before the model is loaded."""
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    Sampling(**kw)
    return kw


def run(args) -> int:
    from ..llama import load
    from ..models import model_source
    from ..train.memory import OVERHEAD

    if args.max_new_tokens is not None:
        checks.count(1)("--max-new-tokens", args.max_new_tokens)
    if args.prompt is None and not args.chat:
        raise GradtapeError("--prompt is required (or use --chat without --prompt for an "
                            "interactive chat)")
    if args.system is not None and not args.chat:
        raise GradtapeError("--system needs --chat")
    if args.prompt is not None:
        checks.utf8_text("--prompt", args.prompt)
    sampling = _sampling(args)
    stop = check_stop_strings(args.stop)
    # the adapter's files before the model is loaded (their contents after)
    adapter_dir = adapter_folder(args.adapter) if args.adapter else None
    # a float32 copy that would not fit (an 8B model's 27.5 GiB) is refused before
    # anything is allocated
    keep = args.weights != "float32" or keep_stored(
        "float32", model_source(args.model)[0], mem_available(), None, args.model, OVERHEAD)
    model = load(args.model, keep_quantized=keep)
    tok = model.tokenizer
    if tok is None:
        raise GradtapeError(f"{args.model}: the model has no tokenizer (no tokenizer.json)")
    if args.chat and not tok.chat_template:
        raise GradtapeError(f"{args.model}: the model has no chat template; use --prompt "
                            "without --chat")
    adapter = None
    if adapter_dir is not None:
        from ..models.lora import load_adapter
        adapter = load_adapter(adapter_dir, model)
    opts = dict(sampling, adapter=adapter, stop=stop, dtype=np.dtype(args.dtype),
                compute=args.compute)
    if args.prompt is None:
        return chat_repl(model, opts, args.max_new_tokens or 512, args.system)
    history = [{"role": "system", "content": args.system}] if args.system else []
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template(history + [{"role": "user", "content": args.prompt}],
                                       add_generation_prompt=True)
    ids = tok.encode(text)
    if not ids:
        raise GradtapeError("the prompt encodes to no tokens")
    printer = StreamPrinter(tok, skip=model.stop_ids, stop=stop)
    model.generate(ids, args.max_new_tokens or 64, stream=printer, **opts)
    printer.finish()
    return 0


def _fit(model, history, max_new):
    """Prompt ids of the conversation, dropping the oldest exchanges (after a system
    message) until it and ``max_new`` tokens fit the context; None if even the last
    message alone does not fit."""
    tok, ctx = model.tokenizer, model.config.max_seq_len
    first = 1 if history and history[0]["role"] == "system" else 0
    while True:
        ids = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True))
        if len(ids) + max_new <= ctx:
            return ids, history
        if len(history) - first <= 1:
            return None, history
        history = history[:first] + history[first + 2:]  # one user + assistant exchange


def chat_repl(model, opts, max_new, system=None, stdin=None, out=None) -> int:
    """The interactive chat: reads a user message per line until end of input (Ctrl-D),
    answers each with the whole conversation as context.  The prompt marker is shown
    only on a terminal, so piped input gives just the answers."""
    stdin, out = stdin or sys.stdin, out or sys.stdout
    if stdin is None:  # started with its standard input closed
        raise GradtapeError("no standard input to read the chat from; give --prompt")
    tty = stdin.isatty()
    if tty:
        out.write(f"Chat with {model.name or 'the model'}"
                  f"{' (with an adapter)' if opts.get('adapter') else ''}. "
                  "Ctrl-D leaves, Ctrl-C stops an answer.\n")
    history = [{"role": "system", "content": system}] if system else []
    while True:
        if tty:
            try:
                line = input("> ")
            except EOFError:
                out.write("\n")
                return 0
        else:
            line = stdin.readline()
            if not line:
                return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        ids, history = _fit(model, history + [{"role": "user", "content": line}], max_new)
        if ids is None:
            history = history[:-1]
            out.write(f"(that message is longer than the model's context of "
                      f"{model.config.max_seq_len} tokens; not sent)\n")
            continue
        printer = StreamPrinter(model.tokenizer, out, skip=model.stop_ids,
                                stop=opts.get("stop", ()))
        try:
            model.generate(ids, max_new, stream=printer, **opts)
        except KeyboardInterrupt:
            out.write(" [stopped]")
        reply = printer.finish()
        history.append({"role": "assistant", "content": reply})
