"""Test documents and JSONL files: a small mixed corpus of prose, code, digits and non-ASCII text."""

import json
import random


WORDS = "the model reads tokens from files and learns to predict what comes next".split()
UNICODE_WORDS = ["café", "naïve", "über", "日本語", "данные", "🙂", "λ"]


def make_texts(count: int, seed: int = 0) -> list[str]:
    """`count` documents mixing prose, indented code, digits and non-ASCII text."""
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        prose = " ".join(rng.choice(WORDS + UNICODE_WORDS) for _ in range(rng.randint(5, 30)))
        code = (
            f"def function_{i}(x, y={rng.randint(0, 99999)}):\n"
            f"    if x > {rng.randint(0, 9)}:\n"
            f"\t\treturn x * y  # {rng.choice(WORDS)}\n"
            f"    return None\n"
        )
        texts.append(prose + "\n\n" + code if i % 2 else code + "\n" + prose)
    return texts


def write_jsonl(path, records) -> str:
    """Write records (dicts, or raw strings written as they are) one per line; return the path."""
    with open(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)
