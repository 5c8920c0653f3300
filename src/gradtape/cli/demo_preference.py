"""The preference demo (``gradtape demo --method dpo``, or ipo, orpo, simpo): teach
SmolLM2-135M-Instruct a house convention from pairs, and measure it.

The pairs ship in examples/preferences (made by its make_data.py): short arithmetic and
unit questions whose chosen answer ends with a fixed sign-off and whose rejected answer
is the same sentence without it.  The demo trains on the training pairs with the default
options, scores the held-out pairs (reward accuracy and margin, from the run's last eval
line in log.jsonl), and shows greedy answers to held-out prompts before and after, with
how many of them carry the sign-off.

Not here: the SFT demo and the options both share (``cli.demo``), the training itself
(``train.finetune``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import GradtapeError

DATA = Path(__file__).resolve().parents[3] / "examples" / "preferences"
# the convention the pairs teach (examples/preferences/make_data.py's SIGN_OFF)
SIGN_OFF = "-- answered by gradtape"
# per method: steps, peak lr, beta (None: TRL's default).  Set by hand: every method
# reaches full held-out reward accuracy with these; dpo got the steps that let
# the sign-off show in the greedy answers, simpo a larger beta and a lower lr because at
# TRL's beta and lr 1e-3 its greedy answers fall apart (it has no reference to stay near)
SETTINGS = {"dpo": (30, 1e-3, None), "ipo": (20, 1e-3, None), "orpo": (20, 1e-3, None),
            "simpo": (20, 5e-4, 2.0)}


def _read(path):
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise GradtapeError(f"demo data {path}: not readable JSON lines ({e})") from None


def _last_eval(out):
    """The run's last eval line of log.jsonl (``None`` where it has none)."""
    lines = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if x.strip()]
    evals = [r for r in lines if "eval_rewards/accuracies" in r]
    return evals[-1] if evals else None


def _signed(answers):
    return sum(a.rstrip().endswith(SIGN_OFF) for a in answers) / max(len(answers), 1)


def run(args, backend, out, train_and_compare) -> int:
    """Train ``args.method`` on the demo pairs in ``out``; ``train_and_compare`` is the
    SFT demo's course (``cli.demo.train_and_compare``)."""
    from ..train.finetune import FinetuneConfig

    if not (DATA / "train.jsonl").is_file():
        raise GradtapeError(f"demo data not found in {DATA} (run from a source checkout)")
    steps, lr, beta = SETTINGS[args.method]
    held = _read(DATA / "test.jsonl")
    prompts = [p["prompt"] for p in held[:args.eval_n]]
    cfg = FinetuneConfig(data=str(DATA / "train.jsonl"), eval_data=str(DATA / "test.jsonl"),
                         out=str(out), steps=args.steps or steps, method=args.method,
                         beta=beta, seq_len=64, batch_size=4, lr=lr, warmup=3,
                         eval_every=10, save_every=20, backend=backend,
                         compute=args.compute,
                         resume=(out / "checkpoint" / "state.safetensors").is_file())

    # the base model's answers run longer than the pairs' (it explains its sums): room for
    # one of those to end, so that a sign-off after it can show
    before, after, summary = train_and_compare(
        cfg, prompts, lambda tok: 2 * max(len(tok.encode(p["chosen"])) for p in held) + 8,
        lambda before, s: f"base model: {_signed(before):.0%} of {len(prompts)} held-out "
                          f"answers end with the sign-off ({s:.0f} s)")
    ev = _last_eval(out)
    print()
    if ev is not None:
        print(f"held-out pairs ({len(held)}): reward accuracy "
              f"{ev['eval_rewards/accuracies']:.2f}, margin {ev['eval_rewards/margins']:.2f} "
              f"(step {ev['step']})")
    print(f"greedy answers with the sign-off: base {_signed(before):.0%} -> "
          f"{cfg.method} {_signed(after):.0%} ({len(prompts)} held-out prompts; train "
          f"tokens/s {summary['tokens_per_s']:.0f})")
    for p, x, y in list(zip(prompts, before, after))[:3]:
        print(f"\n  prompt: {p}\n  base:   {x[:160]!r}\n  {cfg.method + ':':<8}{y[:160]!r}")
    print(f"\nloss and reward curves: {out / 'loss.png'}   log: {out / 'log.jsonl'}   "
          f"adapter (PEFT): {out / 'adapter'}")
    return 0
