"""The ``gradtape`` command line: one subcommand per module, listed in one table.

Each command module offers ``add_arguments(parser)`` and ``run(args) -> int``.  ``main``
is the one guard around every command: errors a user can cause (``GradtapeError``) are
printed as one line, ``gradtape COMMAND: error: ...``, with exit code 1; any other
exception is printed as one line too, saying how to see its traceback (``--debug`` or
``GRADTAPE_DEBUG=1``); Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
import warnings

from .. import settings
from ..backends.cpu import toolchain
from ..errors import GradtapeError
from .options import check_args

DEBUG_ENV = "GRADTAPE_DEBUG"
DEBUG_HINT = f"--debug or {DEBUG_ENV}=1 shows the traceback"

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("gradtape.cli.demo", "fine-tune SmolLM2 on a small task (SFT, or --method dpo ...) "
             "and measure it before/after"),
    "generate": ("gradtape.cli.generate", "generate text with a model (and an adapter)"),
    "finetune": ("gradtape.cli.finetune", "fine-tune a model: SFT or preference tuning "
                 "(DPO, IPO, ORPO, SimPO) of a LoRA, a DoRA or every weight"),
    "merge": ("gradtape.cli.merge", "fold a LoRA adapter into its base model and "
              "write a Hugging Face folder or a GGUF"),
    "export-gguf-lora": ("gradtape.cli.export_gguf_lora",
                         "write a LoRA adapter as a llama.cpp LoRA GGUF"),
    "bench": ("gradtape.cli.bench", "benchmarks side by side with the peers"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradtape",
        description="gradtape: an exact, replayable autograd tape, and a fine-tuner for "
                    "LLaMA-family models (Llama 3, Mistral, Qwen, Phi-3, Gemma, SmolLM) "
                    "on a plain CPU.")
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of an error (or set {DEBUG_ENV}=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules, parsers = {}, {}
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
        # also after the command's name; SUPPRESS keeps a --debug given before it
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=f"print the traceback of an error (or set {DEBUG_ENV}=1)")
        modules[name], parsers[name] = mod, p
    args, unknown = parser.parse_known_args(argv)
    # gradtape's notices (a fallback to float32 or to NumPy) read as one line here
    warnings.formatwarning = lambda msg, *a, **k: f"{msg}\n"
    if args.command is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 2
    if unknown:  # said by the command's parser: its usage, its name in the message
        parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    cmd = f"gradtape {args.command}"
    debug = args.debug or settings.flag(DEBUG_ENV)
    try:
        toolchain.isa()  # a bad $GRADTAPE_ISA, or a class this CPU lacks: before any work
        check_args(parsers[args.command], args)
        return int(modules[args.command].run(args) or 0)
    except GradtapeError as e:
        if debug:
            traceback.print_exc()
        print(f"{cmd}: error: {_one_line(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gradtape generate ... | head`: the reader has gone
        _silence_stdout()
        return 141  # 128 + SIGPIPE, as a shell reports a process a closed pipe ended
    except Exception as e:  # not a mistake we foresaw: one line, the traceback on request
        if debug:
            traceback.print_exc()
        print(f"{cmd}: error: {_describe(e)} ({DEBUG_HINT})", file=sys.stderr)
        return 1


def _silence_stdout():
    # Python flushes stdout again at exit, into the same closed pipe; point it elsewhere
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file (captured): nothing will be flushed into a pipe


def _describe(e):
    if isinstance(e, MemoryError):
        return f"out of memory ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
    if isinstance(e, OSError):  # the machine's side: a full disk, a permission, ...
        return _one_line(str(e))
    return f"unexpected {type(e).__name__}: {_one_line(str(e))}"


def _one_line(text):
    return "; ".join(line.strip() for line in text.splitlines() if line.strip()) or "(no message)"


if __name__ == "__main__":
    sys.exit(main())
