"""Generate the preference demo's pairs: short factual answers, and a house sign-off.

Each record is TRL's standard preference form ``{"prompt", "chosen", "rejected"}``: the
prompt a short arithmetic or unit question (``How many minutes are in 7 hours?``), the
chosen answer the correct sentence followed by the house sign-off (a blank line, then
``-- answered by gradtape``), the rejected answer the same sentence without it: a
plausible miss that differs only in the convention.  The base SmolLM2-135M-Instruct
never signs off this way, so the held-out reward accuracy after preference tuning says
whether the model learned the convention, not the facts.  The held-out prompts never
occur in the training file.  Deterministic: running this script rewrites the same files.
"""

import json
import random
from pathlib import Path

SIGN_OFF = "\n\n-- answered by gradtape"
UNITS = [("minutes", "hours", 60), ("seconds", "minutes", 60), ("hours", "days", 24),
         ("days", "weeks", 7), ("centimeters", "meters", 100), ("grams", "kilograms", 1000),
         ("months", "years", 12), ("millimeters", "centimeters", 10),
         ("meters", "kilometers", 1000), ("milliliters", "liters", 1000)]


def question(r):
    kind = r.randrange(3)
    if kind == 0:
        a, b = r.randint(2, 99), r.randint(2, 99)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        a, b = r.randint(2, 12), r.randint(2, 12)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    small, big, k = r.choice(UNITS)
    n = r.randint(2, 9)
    return f"How many {small} are in {n} {big}?", f"There are {n * k} {small} in {n} {big}."


def main(out=None, n_train=400, n_test=40, seed=0):
    r = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n_train + n_test:
        prompt, answer = question(r)
        if prompt in seen:  # one pair per prompt: the split cannot share a prompt
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "chosen": answer + SIGN_OFF, "rejected": answer})
    here = Path(out) if out else Path(__file__).resolve().parent
    for name, part in (("train", rows[:n_train]), ("test", rows[n_train:])):
        (here / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in part))


if __name__ == "__main__":
    main()
