"""Built-in tasks: deterministic synthetic examples, for tests and the quickstart.

    generate_task("counting", num_examples=3, digits=2, seed=0)   # ['17,18,19,...', ...]
"""
from __future__ import annotations

import random
from typing import Callable


def _addition(rng: random.Random, digits: int) -> str:
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return f"{a}+{b}={a + b}"


def _reverse(rng: random.Random, digits: int) -> str:
    text = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 2 * digits)))
    return f"{text}>{text[::-1]}"


def _counting(rng: random.Random, digits: int) -> str:
    start = rng.randrange(10**digits)
    return ",".join(str(start + i) for i in range(8))


BUILTIN_TASKS: dict[str, Callable[[random.Random, int], str]] = {
    "addition": _addition,   # 123+456=579
    "reverse": _reverse,     # 1234>4321
    "counting": _counting,   # 17,18,19,20,21,22,23,24
}


def generate_task(name: str, *, num_examples: int, digits: int, seed: int) -> list[str]:
    """Deterministic examples of a built-in task."""
    rng = random.Random(seed)
    make = BUILTIN_TASKS[name]
    return [make(rng, digits) for _ in range(num_examples)]
