"""The ``gradtape`` command line: one subcommand per module, listed in one table.

Each command module offers ``add_arguments(parser)`` and ``run(args) -> int``.  Errors a
user can cause (``GradtapeError``) are printed as one line, with a non-zero exit code and
no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from ..errors import GradtapeError

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("gradtape.cli.demo", "LoRA-fine-tune SmolLM2 on a small task and measure it before/after"),
    "generate": ("gradtape.cli.generate", "generate text with a model (and an adapter)"),
    "finetune": ("gradtape.cli.finetune", "LoRA-fine-tune a LLaMA-family model"),
    "merge": ("gradtape.cli.merge", "fold a LoRA adapter into its base model and "
              "write a Hugging Face folder or a GGUF"),
    "export-gguf-lora": ("gradtape.cli.export_gguf_lora",
                         "write a LoRA adapter as a llama.cpp LoRA GGUF"),
    "bench": ("gradtape.cli.bench", "benchmarks side by side with the peers"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradtape",
        description="gradtape: an exact, replayable autograd tape and a LoRA fine-tuner "
                    "for LLaMA-family models on a plain CPU.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue  # a command whose module is not part of this build
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        modules[name] = mod
    args = parser.parse_args(argv)
    # gradtape's notices (a fallback to float32 or to NumPy) read as one line here
    warnings.formatwarning = lambda msg, *a, **k: f"{msg}\n"
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except GradtapeError as e:
        print(f"gradtape {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gradtape {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
