"""Fine-tune a LLaMA-family model (GGUF or Hugging Face folder) on a CPU: SFT or preference
tuning, of a LoRA, a DoRA or every weight.

Data (--data): a .jsonl, .json (an array) or .parquet file, or a dataset folder as the Hub
downloads it (its train split: data/train-00000-of-00001.parquet ...), of records in one
schema, detected from the first: OpenAI chat {"messages": [{"role", "content"}, ...]},
ShareGPT {"conversations": [{"from", "value"}, ...]}, Alpaca {"instruction", "input",
"output"} (loss on the assistant turns / output), {"prompt", "completion"} (loss on the
completion) or {"text"}; other field names map with --columns prompt=question,... .
Any other file is plain text (cut into --seq-len sequences).  Examples are packed into
--seq-len rows, each attending only to itself (--no-packing: one example a row, padded).

Preference tuning (--method dpo, ipo, orpo or simpo; --beta, --label-smoothing,
--simpo-gamma): --data holds pairs, {"prompt", "chosen", "rejected"} as text or as
messages, or {"chosen", "rejected"} with the prompt implicit (their common start);
--batch-size counts pairs.  dpo and ipo compute the starting model's log-probabilities
once, before the first step (reference.safetensors in --out).

What is trained (--fine-tune-type): lora (default), dora (PEFT's use_dora: a magnitude
per output feature beside A and B; a quantized GGUF stays quantized), both written as
PEFT writes them (--rslora scales alpha / sqrt(r), PEFT's use_rslora); or full (every
weight, written to model/ as a Hugging Face folder, --save-gguf also as a GGUF).

--adapter DIR continues from a PEFT LoRA folder (after an SFT run, say), for any method:
its rank, alpha and targets are the run's, and for dpo and ipo the model with it is
the reference.

Writes into --out: adapter/ (Hugging Face PEFT format), checkpoint/ (--resume continues
from it), log.jsonl (every step; at each evaluation the samples' answers), loss.png
(train and eval loss curves), config.yaml (every option's value: --config takes it).

Options may come from a YAML file (--config run.yaml), keys spelled as the flags without
their dashes (seq-len: 512, or seq_len), flags given on the command line winning.
At each evaluation (--eval-every) the run prints greedy answers to a few held-out prompts
(--samples, --sample-prompts); --early-stop N ends it after N evaluations without a lower
held-out loss, adapter/ holding the best evaluation's weights.

Example:
  gradtape finetune --model smollm2 --data chats.jsonl --out runs/chat --steps 200

Data-parallel over N processes (pip install 'gradtape[mpi]'; each rank takes
--batch-size sequences, or pairs, of every N x --batch-size micro-batch; rank 0 writes
the files):
  mpiexec -n 2 gradtape finetune --model smollm2 --data chats.jsonl --out runs/chat
"""

from __future__ import annotations

import argparse
import dataclasses

from ..errors import GradtapeError
from ..train.config_file import read_config
from ..train.finetune import FinetuneConfig, finetune, flag
from .options import with_range


def add_arguments(parser):
    """One option per ``FinetuneConfig`` field, with its help text and declared range;
    the values are checked by ``FinetuneConfig`` itself (the same check as for the Python
    API).  An option not given is absent from the parsed arguments (``SUPPRESS``), so
    that ``--config``'s value or the field's default applies."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="a YAML file of options: key: value lines, each key an "
                             "option's flag without its dashes, with - or _ (seq-len: 512, "
                             "no-packing: true; paths relative to the current folder, as "
                             "flags' are); options given on the command line win; a run's "
                             "--out/config.yaml reads back as one")
    for f in dataclasses.fields(FinetuneConfig):
        meta = f.metadata
        if meta.get("cli") is False:
            continue
        if f.type in ("bool", bool) and f.default:  # on unless turned off: --no-packing
            parser.add_argument("--no-" + flag(f.name)[2:], dest=f.name, action="store_false",
                                default=argparse.SUPPRESS, help=meta["help"])
        elif f.type in ("bool", bool):
            parser.add_argument(flag(f.name), action="store_true", default=argparse.SUPPRESS,
                                help=meta["help"])
        else:
            kind = meta.get("kind") or {"int": int, "float": float, "str": str}[
                f.type if isinstance(f.type, str) else f.type.__name__]
            # required: by FinetuneConfig (--config may give it); no "(default: )", nor
            # "(default: None)": the help says what None means
            shown = not meta.get("required") and f.default not in ("", None)
            default = str(f.default).replace("%", "%%")
            help_text = meta["help"] + (f" (default: {default})" if shown else "")
            parser.add_argument(flag(f.name), type=kind, default=argparse.SUPPRESS,
                                help=with_range(help_text, meta["check"]))


def run(args) -> int:
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    try:
        given = {k: v for k, v in vars(args).items() if k in names}
        from_file = read_config(args.config, FinetuneConfig) if args.config else {}
        cfg = FinetuneConfig(**{**from_file, **given})
    except GradtapeError:
        from ..train import distributed
        if not distributed.world().is_root:  # MPI: every rank finds it; rank 0 says it
            return 1
        raise
    try:
        summary = finetune(cfg)
    except GradtapeError as e:
        if getattr(e, "quiet", False):  # another MPI rank reports it
            return 1
        raise
    if summary["rank"] != 0:  # MPI: rank 0 speaks for the run
        return 0
    print(f"final train loss {summary['final_loss']:.4f}"
          + (f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else "")
          + (f", {summary['tokens_per_s']:.0f} target tokens/s"
             if summary["tokens_per_s"] is not None else "")
          + (f"; {'model' if cfg.fine_tune_type == 'full' else 'adapter'} from step "
             f"{summary['best_step']}" if summary.get("best_step") else ""))
    return 0
