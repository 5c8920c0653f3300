"""The demo: teach SmolLM2-135M-Instruct a new skill with LoRA, and measure it.

The skill: answer a bare ``key=value`` record (``name=Mara; city=Oslo; age=34``) with
exactly its compact JSON (``{"name": "Mara", "city": "Oslo", "age": 34}``).  The data
ships in examples/records (made by its make_data.py).  The demo measures the exact-match
rate of greedy answers on held-out records with the base model, fine-tunes, measures it
again with the adapter, and shows a few answers before and after.  ``--method dpo`` (or
ipo, orpo, simpo) runs the preference demo instead (``cli.demo_preference``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import checks
from ..backends import BACKENDS
from ..plan import COMPUTE_CHOICES, DEFAULT_COMPUTE
from ..errors import GradtapeError
from ..train.methods import METHODS
from . import demo_preference
from .options import option

DATA = Path(__file__).resolve().parents[3] / "examples" / "records"


def add_arguments(parser):
    option(parser, "--method", checks.one_of(*METHODS), default="sft",
           help="sft: learn a JSON format from examples; dpo, ipo, orpo, simpo: learn a "
                "sign-off from preference pairs (examples/preferences) and report the "
                "held-out reward accuracy (default: %(default)s)")
    option(parser, "--out", _run_folder,
           help="run folder (default: runs/demo, or runs/demo-METHOD for a preference "
                "method)")
    option(parser, "--steps", checks.count(1), type=int,
           help="training steps (default: 30, or 20 for a preference method)")
    option(parser, "--eval-n", checks.count(1), type=int, default=30,
           help="held-out records to score, or held-out prompts to answer for a preference "
                "method (default: %(default)s)")
    option(parser, "--backend", checks.one_of("auto", *BACKENDS), default="auto",
           help="numpy, cpu, or auto (cpu when available; default: %(default)s)")
    option(parser, "--compute", checks.one_of(*COMPUTE_CHOICES), default=DEFAULT_COMPUTE,
           help="precision of the training step's frozen-weight GEMMs: auto picks bf16 where "
                "this CPU runs it faster, else float32; int8: bf16, and int8 GEMMs against a "
                "quantized GGUF's weights (default: %(default)s)")


def _run_folder(name, value):
    """--out: a new, empty or earlier demo folder we can write in (checked before the
    model is loaded; a demo run continues an earlier one)."""
    from ..train.run_folder import check_out_folder

    out = Path(value).expanduser()
    check_out_folder(out, resume=(out / "checkpoint" / "state.safetensors").is_file())


def _answers(model, prompts, max_new, adapter=None):
    outs = []
    for p in prompts:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                   add_generation_prompt=True)
        ids = model.generate(model.tokenizer.encode(text), max_new, adapter=adapter)
        outs.append(model.tokenizer.decode(ids).replace("<|im_end|>", "").strip())
    return outs


def _score(answers, references):
    return sum(a == r for a, r in zip(answers, references)) / max(len(references), 1)


def _load_model(cfg):
    """SmolLM2 with its weights as finetune holds them for ``cfg``: the file's blocks where
    the step's products read them (int8, or bf16 from copies of the blocks), else a
    float32 copy."""
    from .. import llama
    from ..train.finetune import reads_blocks

    model = llama.load("smollm2", keep_quantized=True)
    if cfg.compute != "int8" and not reads_blocks(cfg.compute, cfg.backend, cfg.micro_rows,
                                                  model):
        model = llama.load("smollm2")
    return model


def train_and_compare(cfg, prompts, reply_tokens, describe):
    """The demos' common course: SmolLM2 loaded as finetune holds it (``_load_model``),
    its greedy answers to ``prompts`` (at most ``reply_tokens(tokenizer)`` tokens each)
    before and after training with ``cfg``.  ``describe(before, seconds)``: the line
    printed about the base model's answers.  Returns ``(before, after, summary)``."""
    from .. import models
    from ..train.finetune import finetune

    print("loading SmolLM2-135M-Instruct ...", flush=True)
    model = _load_model(cfg)
    max_new = reply_tokens(model.tokenizer)
    t = time.perf_counter()
    before = _answers(model, prompts, max_new)
    print(describe(before, time.perf_counter() - t), flush=True)
    summary = finetune(cfg, model=model)
    adapter = models.load_adapter(Path(cfg.out) / "adapter", model)
    return before, _answers(model, prompts, max_new, adapter), summary


def run(args) -> int:
    from ..train.finetune import FinetuneConfig

    backend = args.backend
    if backend == "auto":
        backend = "cpu" if "cpu" in BACKENDS else "numpy"
    if args.method != "sft":
        out = Path(args.out or f"runs/demo-{args.method}").expanduser()
        if args.out is None:  # a given --out was checked as the options were parsed
            _run_folder("--out", str(out))
        return demo_preference.run(args, backend, out, train_and_compare)
    if not (DATA / "train.jsonl").is_file():
        raise GradtapeError(f"demo data not found in {DATA} (run from a source checkout)")
    test = [json.loads(line) for line in (DATA / "test.jsonl").read_text().splitlines()]
    test = test[:args.eval_n]
    prompts = [t["messages"][0]["content"] for t in test]
    refs = [t["messages"][1]["content"] for t in test]

    out = Path(args.out or "runs/demo").expanduser()
    if args.out is None:
        _run_folder("--out", str(out))
    # the records (51-87 tokens) packed into rows of 352: about 18 records a step where 4
    # padded rows of 88 held 4, for far less than 4x the step's time (a step's cost is far
    # from proportional to its rows: bench/packing_rate.py)
    # "fit": a small model's run fits without recomputation, which "auto" would trade for time
    cfg = FinetuneConfig(data=str(DATA / "train.jsonl"), out=str(out), steps=args.steps or 30,
                         seq_len=352, batch_size=4, rank=8, alpha=16.0, lr=2e-3, warmup=5,
                         grad_checkpoint="fit",
                         eval_every=20, save_every=20, backend=backend, compute=args.compute,
                         resume=(out / "checkpoint" / "state.safetensors").is_file())

    # an answer still going past the longest reference (+ its end token) cannot match
    before, after, summary = train_and_compare(
        cfg, prompts, lambda tok: max(len(tok.encode(r)) for r in refs) + 2,
        lambda before, s: f"base model: {_score(before, refs):.0%} exact JSON on "
                          f"{len(refs)} held-out records ({s:.0f} s)")
    b, a = _score(before, refs), _score(after, refs)
    print()
    print(f"held-out exact match: base {b:.0%} -> fine-tuned {a:.0%} "
          f"({len(refs)} records; train tokens/s {summary['tokens_per_s']:.0f})")
    for p, r, x, y in list(zip(prompts, refs, before, after))[:3]:
        print(f"\n  record:     {p}\n  expected:   {r}\n  base:       {x[:100]!r}\n"
              f"  fine-tuned: {y[:100]!r}")
    print(f"\nloss curve: {out / 'loss.png'}   log: {out / 'log.jsonl'}   "
          f"adapter (PEFT): {out / 'adapter'}")
    return 0
