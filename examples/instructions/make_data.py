"""Generate a small Alpaca-style instruction set: ``instruction`` / ``input`` / ``output``.

Sixteen kinds of short task (add or multiply numbers, sort or pick from a list, reverse,
spell or capitalise a word, opposites, plurals, a temperature in Fahrenheit, counting,
a greeting, a numbered list, ...), each phrased in two or three ways, some with an input
and some without.  Every answer is a rule applied to the question, so a model can learn
it and a held-out record is answerable.  Words and names are the script's own lists; no
outside text.  Deterministic: running this script rewrites the same files (360 training
records in train.jsonl, 40 held out in test.jsonl).
"""

import json
import random
from pathlib import Path

WORDS = ["garden", "window", "silver", "planet", "button", "candle", "forest", "pocket",
         "ladder", "basket", "rocket", "pencil", "mirror", "orange", "bridge", "tunnel",
         "marble", "kettle", "violin", "saddle", "harbor", "meadow", "lantern", "compass"]
NOUNS = {"cat": "cats", "box": "boxes", "city": "cities", "leaf": "leaves", "child":
         "children", "mouse": "mice", "bus": "buses", "story": "stories", "knife": "knives",
         "tooth": "teeth", "dish": "dishes", "toy": "toys", "wolf": "wolves", "hero": "heroes",
         "baby": "babies", "foot": "feet", "glass": "glasses", "key": "keys"}
OPPOSITES = {"hot": "cold", "early": "late", "open": "closed", "heavy": "light", "wide":
             "narrow", "loud": "quiet", "empty": "full", "rough": "smooth", "sharp": "dull",
             "strong": "weak", "fast": "slow", "high": "low", "wet": "dry", "young": "old",
             "hard": "soft", "deep": "shallow", "thick": "thin", "bright": "dark"}
NAMES = ["Mara", "Jonas", "Aiko", "Liam", "Sofia", "Omar", "Nina", "Pavel", "Chen", "Amara",
         "Ines", "Tariq", "Elena", "Kofi", "Hana", "Mateo", "Freya", "Ravi", "Zoe", "Emil"]
PLACES = ["the library", "the workshop", "the museum", "the bakery", "the harbor",
          "the garden club", "the chess club", "the climbing gym", "the choir"]
ITEMS = ["milk", "bread", "eggs", "apples", "rice", "soap", "tea", "butter", "onions",
         "lemons", "flour", "honey", "beans", "cheese", "pasta", "salt"]
ADJECTIVES = ["green", "quiet", "small", "brave", "yellow", "gentle", "rapid", "ancient"]


def _numbers(r, n, lo=1, hi=99):
    return r.sample(range(lo, hi + 1), n)


def add(r):
    a, b = _numbers(r, 2, 10, 499)
    q = r.choice(["Add the two numbers.", "What is the sum of these numbers?",
                  "Compute the total."])
    return q, f"{a} and {b}", str(a + b)


def multiply(r):
    a, b = r.randint(2, 12), r.randint(2, 12)
    q = r.choice(["Multiply the two numbers.", "What is the product?"])
    return q, f"{a} x {b}", str(a * b)


def sort_numbers(r):
    xs = _numbers(r, r.randint(3, 6))
    q = r.choice(["Sort these numbers from smallest to largest.",
                  "Put the numbers in increasing order."])
    return q, ", ".join(map(str, xs)), ", ".join(map(str, sorted(xs)))


def largest(r):
    xs = _numbers(r, r.randint(3, 6))
    q = r.choice(["Which number in the list is the largest?", "Find the maximum."])
    return q, ", ".join(map(str, xs)), str(max(xs))


def reverse(r):
    w = r.choice(WORDS)
    q = r.choice(["Reverse the letters of the word.", "Write the word backwards."])
    return q, w, w[::-1]


def spell(r):
    w = r.choice(WORDS)
    return f"Spell the word \"{w}\" letter by letter.", "", "-".join(w.upper())


def capitals(r):
    words = " ".join(r.sample(ADJECTIVES, 1) + r.sample(WORDS, r.randint(1, 2)))
    q = r.choice(["Write the phrase in capital letters.", "Convert the text to upper case."])
    return q, words, words.upper()


def opposite(r):
    w = r.choice(list(OPPOSITES))
    q = r.choice(["Give the opposite of the word.", "What is the antonym?"])
    return q, w, OPPOSITES[w]


def plural(r):
    w = r.choice(list(NOUNS))
    q = r.choice(["Give the plural of the noun.", "Write the plural form."])
    return q, w, NOUNS[w]


def fahrenheit(r):
    c = 5 * r.randint(-8, 20)
    q = r.choice(["Convert the temperature from Celsius to Fahrenheit.",
                  "How many degrees Fahrenheit is this?"])
    return q, f"{c} C", f"{c * 9 // 5 + 32} F"


def count_words(r):
    words = r.sample(WORDS + ADJECTIVES, r.randint(3, 8))
    q = r.choice(["How many words are in the text?", "Count the words."])
    return q, " ".join(words), str(len(words))


def parity(r):
    n = r.randint(1, 999)
    q = r.choice(["Is the number even or odd?", "Say whether the number is odd or even."])
    return q, str(n), "odd" if n % 2 else "even"


def count_range(r):
    a = r.randint(1, 40)
    b = a + r.randint(3, 7)
    return f"Count from {a} to {b}.", "", ", ".join(map(str, range(a, b + 1)))


def greeting(r):
    name, place = r.choice(NAMES), r.choice(PLACES)
    q = r.choice(["Write a one-line welcome for the new member.",
                  "Greet the person who just joined."])
    return q, f"name: {name}; joined: {place}", f"Welcome to {place}, {name}!"


def numbered(r):
    items = r.sample(ITEMS, r.randint(2, 5))
    q = r.choice(["Turn the list into a numbered list.", "Number the items."])
    return q, ", ".join(items), "\n".join(f"{i}. {x}" for i, x in enumerate(items, 1))


def initials(r):
    words = r.sample(WORDS + ADJECTIVES, r.randint(2, 4))
    q = r.choice(["Give the first letter of each word.", "List the initials."])
    return q, " ".join(words), ", ".join(w[0].upper() for w in words)


TASKS = [add, multiply, sort_numbers, largest, reverse, spell, capitals, opposite, plural,
         fahrenheit, count_words, parity, count_range, greeting, numbered, initials]


def record(r):
    instruction, given, output = r.choice(TASKS)(r)
    return {"instruction": instruction, **({"input": given} if given else {}),
            "output": output}


def rows(n=400):
    """The ``n`` records, each question (instruction and input) once."""
    r = random.Random(2026)
    seen, out = set(), []
    while len(out) < n:
        rec = record(r)
        key = (rec["instruction"], rec.get("input", ""))
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def main():
    here = Path(__file__).parent
    recs = rows()
    for name, part in (("train.jsonl", recs[:360]), ("test.jsonl", recs[360:])):
        (here / name).write_text("".join(json.dumps(x) + "\n" for x in part))


if __name__ == "__main__":
    main()
