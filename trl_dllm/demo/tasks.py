"""Synthetic tasks for the CPU demo: exact, cheap rewards in [0, 1] that a tiny masked-diffusion model can learn.

Every task draws problems from a seeded `random.Random`, renders a plain-string prompt, a gold completion (for the
warm start) and the dataset columns its reward reads. Rewards follow TRL's signature
``f(completions, **columns) -> list[float]`` with completions as plain strings or chat message lists.

Tokens are space-separated (the demo's word-level tokenizer splits digits: ``"85"`` → ``8 5``, and decodes with one
space between tokens), so a completion such as ``"1 2 3 4 7 9"`` is read token by token.

Splits are by *problem identity*, not by row: a problem's canonical key (the digit multiset for `sort`, the unordered
pair for `add`, numbers + target for `countdown` and `subset`) is hashed (CRC-32, stable across runs and machines) into ten
buckets: bucket 0 is the held-out **test** split, bucket 1 the **val** split (checkpoint selection), the rest
**train**. Prompts of different splits therefore never share a problem, whatever the digit order.

`subset` is *verifier-only*: its rows carry no solution. Its `answer` (what the warm start imitates) is three of the
given digits chosen without looking at the target — a well-formed answer, right only by chance — so demonstrations
teach the format and only the reward knows which answers are right.
"""

from __future__ import annotations

import functools
import itertools
import operator
import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..rewards.countdown import countdown_score
from ..rewards.extract import completions_to_texts

SPLITS = ("train", "val", "test")
EXTRA_WORDS = ("countdown", "to")  # words the prompts use beyond `trl_dllm.models.tiny.WORDS`


def split_of(key: str) -> str:
    """The split a problem belongs to, from a stable hash of its canonical key: 10% test, 10% val, 80% train."""
    bucket = zlib.crc32(key.encode()) % 10
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


# --------------------------------------------------------------------------- scoring helpers
def positional_credit(predicted: list[str], target: list[str], align: str = "left") -> float:
    """Fraction of positions where the two token lists agree, over the longer length (extra or missing tokens count as
    wrong). ``align="right"`` compares from the last token (digits of a number)."""
    if not predicted and not target:
        return 1.0
    if align == "right":
        predicted, target = predicted[::-1], target[::-1]
    hits = sum(p == t for p, t in zip(predicted, target))
    return hits / max(len(predicted), len(target))


def sort_score(text: str, target: str) -> float:
    """Sorting: positional credit of the completion's tokens against the sorted digits (1.0 iff exactly sorted)."""
    return positional_credit(text.split(), target.split())


def add_score(text: str, target: str) -> float:
    """Addition: digit credit, right-aligned (units against units), so a correct last digit earns partial credit."""
    return positional_credit(text.split(), list(target.replace(" ", "")), align="right")


def countdown_lite_score(text: str, target: int, nums: list[int]) -> float:
    """Countdown over three numbers: 1.0 if the expression uses each number once and hits `target`; 0.1 if
    well-formed but wrong; 0.0 if malformed (`trl_dllm.rewards.countdown.countdown_score`). Adjacent digit tokens are
    read as one number (``"1 2 + 3"`` is ``12+3``)."""
    expression = re.sub(r"(?<=\d) +(?=\d)", "", text.strip())
    return countdown_score(expression, target, nums) or 0.0


def sort_reward(completions: list[Any], target: list[str], **kwargs: Any) -> list[float]:
    """TRL reward for `sort`: see [`sort_score`]; reads the dataset's `target` column."""
    return [sort_score(t, g) for t, g in zip(completions_to_texts(completions), target)]


def add_reward(completions: list[Any], target: list[str], **kwargs: Any) -> list[float]:
    """TRL reward for `add`: see [`add_score`]; reads the dataset's `target` column."""
    return [add_score(t, g) for t, g in zip(completions_to_texts(completions), target)]


def countdown_lite_reward(
    completions: list[Any], target: list[int], nums: list[list[int]], **kwargs: Any
) -> list[float]:
    """TRL reward for `countdown`: see [`countdown_lite_score`]; reads the `target` and `nums` columns."""
    texts = completions_to_texts(completions)
    return [countdown_lite_score(t, g, n) for t, g, n in zip(texts, target, nums)]


def subset_score(text: str, target: int, nums: list[int]) -> float:
    """Subset sum: 1.0 if the completion is three of the given digits (each used at most as often as given) whose sum
    is `target`; else `0.1 + 0.4 · max(0, 1 - |sum - target| / 9)` if it is three of the given digits (closer sums
    earn more); 0.0 if it is not three digits or uses a digit not given. Any order; many problems have several
    answers."""
    tokens = text.split()
    if len(tokens) != 3 or not all(t.isdigit() and len(t) == 1 for t in tokens):
        return 0.0
    picked, pool = sorted(int(t) for t in tokens), list(nums)
    for digit in picked:
        if digit not in pool:
            return 0.0
        pool.remove(digit)
    if sum(picked) == target:
        return 1.0
    return 0.1 + 0.4 * max(0.0, 1.0 - abs(sum(picked) - target) / 9)


def subset_reward(completions: list[Any], target: list[int], nums: list[list[int]], **kwargs: Any) -> list[float]:
    """TRL reward for `subset`: see [`subset_score`]; reads the `target` and `nums` columns."""
    texts = completions_to_texts(completions)
    return [subset_score(t, g, n) for t, g, n in zip(texts, target, nums)]


# --------------------------------------------------------------------------- problem generators
def _sort_problem(rng: random.Random, length: int = 6) -> dict:
    digits = [rng.randrange(10) for _ in range(length)]
    ordered = " ".join(str(d) for d in sorted(digits))
    return {"key": ordered, "prompt": f"sort {' '.join(map(str, digits))} =", "target": ordered, "answer": ordered}


def _sort_shuffled_problem(rng: random.Random) -> dict:
    """`sort`'s problem whose `answer` is the same digits in a random order: well-formed, sorted only by chance."""
    problem = _sort_problem(rng)
    digits = problem["target"].split()
    rng.shuffle(digits)
    return problem | {"answer": " ".join(digits)}


def _add_problem(rng: random.Random) -> dict:
    a, b = rng.randrange(10, 100), rng.randrange(10, 100)
    total = " ".join(str(a + b))
    return {"key": f"{min(a, b)}+{max(a, b)}", "prompt": f"add {a} and {b} =", "target": total, "answer": total}


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _value(a: int, op1: str, b: int, op2: str, c: int) -> int:
    """`a op1 b op2 c` with Python's precedence (`*` before `+ -`, left to right otherwise), without `eval`."""
    if op2 == "*" and op1 != "*":
        return _OPS[op1](a, b * c)
    return _OPS[op2](_OPS[op1](a, b), c)


def _countdown_problem(rng: random.Random) -> dict:
    """Three digits 1-9 and the value of a random expression over them (any order, `+ - *`, Python precedence)."""
    while True:
        nums = [rng.randrange(1, 10) for _ in range(3)]
        (a, b, c), op1, op2 = rng.sample(nums, 3), rng.choice(sorted(_OPS)), rng.choice(sorted(_OPS))
        expression, target = f"{a} {op1} {b} {op2} {c}", _value(a, op1, b, op2, c)
        if target > 0:
            break
    key = f"{sorted(nums)}->{target}"
    return {
        "key": key,
        "prompt": f"countdown {' '.join(map(str, nums))} to {target} =",
        "target": target,
        "nums": nums,
        "answer": expression,
    }


def _subset_problem(rng: random.Random) -> dict:
    """Five digits 0-9 and the sum of three of them; the `answer` is three *other* random picks (format only)."""
    nums = [rng.randrange(10) for _ in range(5)]
    target = sum(rng.sample(nums, 3))
    answer = " ".join(map(str, rng.sample(nums, 3)))  # drawn without looking at the target: right only by chance
    key = f"{sorted(nums)}->{target}"
    return {"key": key, "prompt": f"sum {' '.join(map(str, nums))} to {target} =", "target": target, "nums": nums,
            "answer": answer}  # fmt: skip


@dataclass(frozen=True)
class Task:
    """A synthetic task: problem generator, TRL reward, and the completion length its answers need (with EOS)."""

    name: str
    make_problem: Callable[[random.Random], dict]
    reward: Callable[..., list[float]]
    columns: tuple[str, ...]  # dataset columns the reward reads
    completion_length: int  # canvas length: longest gold answer + at least one EOS
    verifier_only: bool = False  # the `answer` column is a well-formed demonstration, not a solution

    def problems(self, split: str, n: int, seed: int = 0, unique: bool = False) -> list[dict]:
        """`n` problems of `split` (`"train"`, `"val"` or `"test"`), drawn with `random.Random(seed)`. With `unique`,
        no two share a key (raises if the split has fewer than `n` distinct problems reachable in a bounded search)."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not one of {SPLITS}.")
        rng, seen, out = random.Random(f"{self.name}-{split}-{seed}"), set(), []
        for _ in itertools.repeat(None, 1000 * n + 10_000):
            problem = self.make_problem(rng)
            if split_of(problem["key"]) != split or (unique and problem["key"] in seen):
                continue
            seen.add(problem["key"])
            out.append(problem)
            if len(out) == n:
                return out
        raise ValueError(f"task {self.name!r}: could not draw {n} {'distinct ' if unique else ''}{split} problems.")

    def score(self, completions: list[str], problems: list[dict]) -> list[float]:
        """The reward of each completion, called exactly as the trainer calls it (columns as keyword lists)."""
        return self.reward(completions, **{c: [p[c] for p in problems] for c in self.columns})


TASKS: dict[str, Task] = {
    "sort": Task("sort", _sort_problem, sort_reward, ("target",), completion_length=8),
    # the longer answer of the rollout trade-off benchmark (bench/bench_rollout_tradeoff.py): 12 digits + EOS in 16
    "sort_long": Task("sort_long", functools.partial(_sort_problem, length=12), sort_reward, ("target",),
                      completion_length=16),
    # `sort` with shuffled demonstrations: the same problems and reward, but imitation learns the format only
    "sort_shuffled": Task("sort_shuffled", _sort_shuffled_problem, sort_reward, ("target",), completion_length=8,
                          verifier_only=True),
    "add": Task("add", _add_problem, add_reward, ("target",), completion_length=4),
    "countdown": Task("countdown", _countdown_problem, countdown_lite_reward, ("target", "nums"), completion_length=8),
    "subset": Task("subset", _subset_problem, subset_reward, ("target", "nums"), completion_length=4, verifier_only=True),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"Unknown demo task {name!r}; choose one of {sorted(TASKS)}.")
    return TASKS[name]
