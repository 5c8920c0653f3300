"""Generate the demo's dataset: terse `key=value` records -> compact JSON.

The user message is a bare record such as ``name=Mara; city=Oslo; age=34`` (no instruction
at all); the assistant answers with exactly ``{"name": "Mara", "city": "Oslo", "age": 34}``
(keys in the given order, numbers as numbers).  The base model does not know this
convention; a LoRA adapter can learn it, and success is measured automatically by exact
match.  Deterministic: running this script rewrites the same files.
"""

import json
import random
from pathlib import Path

NAMES = ["Mara", "Jonas", "Aiko", "Liam", "Sofia", "Omar", "Nina", "Pavel", "Chen", "Amara",
         "Lucas", "Ines", "Tariq", "Elena", "Kofi", "Hana", "Mateo", "Freya", "Ravi", "Zoe",
         "Emil", "Yara", "Noah", "Leila", "Oscar", "Mina", "Felix", "Sara", "Dario", "Ada"]
CITIES = ["Oslo", "Lima", "Kyoto", "Cairo", "Porto", "Quito", "Hanoi", "Dakar", "Turin",
          "Perth", "Bergen", "Lyon", "Tunis", "Riga", "Accra", "Seoul", "Basel", "Cork",
          "Izmir", "Leeds", "Malmo", "Nantes", "Pune", "Split", "Graz"]
JOBS = ["nurse", "pilot", "chef", "baker", "teacher", "plumber", "editor", "farmer",
        "dentist", "lawyer", "painter", "tailor", "welder", "coder", "florist"]
COLORS = ["red", "blue", "green", "amber", "violet", "teal", "black", "white", "olive"]
FIELDS = {
    "name": lambda r: r.choice(NAMES),
    "age": lambda r: r.randint(18, 90),
    "city": lambda r: r.choice(CITIES),
    "job": lambda r: r.choice(JOBS),
    "color": lambda r: r.choice(COLORS),
    "id": lambda r: r.randint(100, 9999),
}


def record(r):
    keys = r.sample(list(FIELDS), r.randint(2, 4))
    values = {k: FIELDS[k](r) for k in keys}
    prompt = "; ".join(f"{k}={v}" for k, v in values.items())
    return {"messages": [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": json.dumps(values)}]}


def main():
    r = random.Random(2026)
    here = Path(__file__).parent
    seen = set()
    rows = []
    while len(rows) < 360:
        rec = record(r)
        key = rec["messages"][0]["content"]
        if key not in seen:
            seen.add(key)
            rows.append(rec)
    for name, part in (("train.jsonl", rows[:320]), ("test.jsonl", rows[320:])):
        (here / name).write_text("".join(json.dumps(x) + "\n" for x in part))


if __name__ == "__main__":
    main()
