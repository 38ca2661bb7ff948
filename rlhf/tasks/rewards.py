"""Built-in reward functions, called with keyword arguments (rlhf.tasks.scoring): completions, answers, prompts and
each row's other dataset columns; each takes what it needs and returns one float per completion.

    exact_match      the completion, stripped, equals the answer
    last_number      the last number in the completion equals the answer's number ("10 + 4 = 14." scores 1 for 14)
    contains_answer  the answer appears in the completion
    math_equal       math-verify's equivalence of the answer and the completion (GSM8K / MATH style, LaTeX too);
                     needs `pip install math-verify`
    format_regex     the completion matches reward.format_regex (re.search, DOTALL)
"""

from __future__ import annotations

import re
from typing import Any

from rlhf.tasks.base import register_reward

NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _same_length(name: str, completions: list[str], answers: list[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"{name}: got {len(completions)} completions and {len(answers)} answers")


@register_reward("exact_match")
def exact_match(completions: list[str], answers: list[str], prompts: Any = None, **_: Any) -> list[float]:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer; else 0.0."""
    _same_length("exact_match", completions, answers)
    return [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answers)]


def number_of(text: str, last: bool = True) -> float | None:
    """The last (or only) number written in `text` (thousands commas allowed), or None."""
    found = NUMBER.findall(str(text))
    if not found:
        return None
    try:
        return float(found[-1 if last else 0].replace(",", ""))
    except ValueError:
        return None


@register_reward("last_number")
def last_number(completions: list[str], answers: list[str], prompts: Any = None, **_: Any) -> list[float]:
    """1.0 when the last number in the completion equals the answer's number (within 1e-6); else 0.0."""
    _same_length("last_number", completions, answers)
    out = []
    for c, a in zip(completions, answers):
        want, got = number_of(a), number_of(c)
        out.append(1.0 if want is not None and got is not None and abs(want - got) <= 1e-6 * max(1.0, abs(want))
                   else 0.0)
    return out


@register_reward("contains_answer")
def contains_answer(completions: list[str], answers: list[str], prompts: Any = None, **_: Any) -> list[float]:
    """1.0 when the answer (stripped, non-empty) appears in the completion; else 0.0."""
    _same_length("contains_answer", completions, answers)
    return [1.0 if str(a).strip() and str(a).strip() in c else 0.0 for c, a in zip(completions, answers)]


@register_reward("math_equal")
def math_equal(completions: list[str], answers: list[str], prompts: Any = None, **_: Any) -> list[float]:
    """1.0 when math-verify finds the completion's answer equivalent to the reference (numbers, fractions, LaTeX
    expressions, \\boxed{}); else 0.0."""
    _same_length("math_equal", completions, answers)
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("the math_equal reward needs math-verify: pip install math-verify") from None
    out = []
    for c, a in zip(completions, answers):
        gold = parse(str(a) if "$" in str(a) or "\\" in str(a) else f"${a}$")
        out.append(1.0 if gold and verify(gold, parse(c)) else 0.0)
    return out


@register_reward("format_regex")
def format_regex(completions: list[str], answers: Any = None, prompts: Any = None, pattern: str = "",
                 **_: Any) -> list[float]:
    """1.0 when the completion matches reward.format_regex (re.search with DOTALL); else 0.0."""
    if not pattern:
        raise ValueError("format_regex: set reward.format_regex to the pattern a well-formed completion matches")
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.search(c) else 0.0 for c in completions]
