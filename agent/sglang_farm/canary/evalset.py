"""Pure: the eval gate's core (issue 23 #3; docs/canary.md, "The eval gate"): an eval set
read from JSON Lines, the answer taken from a reply GSM8K-style, a score, and the verdict
that fails a canary whose score is below the baseline's by more than a tolerance.

Latency and error checks cannot see a model that answers wrong (a broken kernel, a
quantization, a chat template lost in an upgrade); a handful of questions with known
answers can. Exact text differs across SGLang versions and batch sizes even at
temperature 0, so the gate compares *scores* of the canary and of a baseline worker on
the same questions, never their text, and allows an absolute tolerance for the answers
that flip either way.

Numbers are `Decimal`s: "1,000", "1000" and "1000.0" are the same answer, with no float
rounding in the comparison.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

# A number as people and models write it: an optional sign, digits with or without
# thousands commas, an optional decimal part. A minus counts as a sign only where it
# cannot be a subtraction ("10-3" is 10 and 3; "= -3" is -3).
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
# GSM8K's reference answers end "#### 72"; a model prompted that way may do the same.
_MARK = "####"
_KEYS = ("prompt", "answer", "id")


class EvalSetError(ValueError):
    """An eval set that cannot be used, with every problem found (each names its line)."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{source}: the eval set cannot be used:\n{lines}")


@dataclass(frozen=True, slots=True)
class EvalItem:
    """One question: the prompt sent as the user's message, and the number expected."""

    line: int  # 1-based line in the file, for messages
    prompt: str
    answer: Decimal
    id: str | None = None

    @property
    def name(self) -> str:
        return f"line {self.line}" if self.id is None else f"{self.id!r} (line {self.line})"


def parse_number(text: str) -> Decimal | None:
    """`text` as one number ("1,234.5", "-3", " 42 "), or None if it is not exactly one."""
    stripped = text.strip()
    match = _NUMBER.fullmatch(stripped)
    if match is None:
        return None
    try:
        return Decimal(stripped.replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the pattern admits only valid decimals
        return None


def _answer(value: object) -> Decimal | None:
    if isinstance(value, bool):
        return None  # JSON true/false are not numbers here, although Python's bool is an int
    if isinstance(value, int | Decimal):
        return Decimal(value) if Decimal(value).is_finite() else None
    if isinstance(value, str):
        return parse_number(value)
    return None


def _item(lineno: int, raw: str, problems: list[str]) -> EvalItem | None:
    where = f"line {lineno}"
    try:
        obj = json.loads(raw, parse_float=Decimal)
    except json.JSONDecodeError as exc:
        problems.append(
            f"{where}: not JSON ({exc.msg} at column {exc.colno}); each line must be one "
            'object such as {"prompt": "What is 2 + 3?", "answer": 5}'
        )
        return None
    if not isinstance(obj, dict):
        problems.append(
            f"{where}: expected a JSON object with keys prompt and answer, got {type(obj).__name__}"
        )
        return None
    unknown = sorted(set(obj) - set(_KEYS))
    missing = [k for k in ("prompt", "answer") if k not in obj]
    if unknown:
        problems.append(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; accepted: prompt, answer, id"
        )
    if missing:
        problems.append(f"{where}: missing key(s) {', '.join(missing)}; add them")
    if unknown or missing:
        return None
    prompt, answer, ident = obj["prompt"], _answer(obj["answer"]), obj.get("id")
    ok = True
    if not isinstance(prompt, str) or not prompt.strip():
        problems.append(f"{where}: prompt: expected a non-empty string, got {prompt!r}")
        ok = False
    if answer is None:
        problems.append(
            f"{where}: answer: expected a number or a numeric string such as 42, -3.5 or "
            f'"1,000", got {obj["answer"]!r}'
        )
        ok = False
    if ident is not None and (not isinstance(ident, str) or not ident):
        problems.append(f"{where}: id: expected a non-empty string, got {ident!r}")
        ok = False
    if not ok:
        return None
    assert isinstance(prompt, str) and answer is not None
    return EvalItem(lineno, prompt, answer, ident if isinstance(ident, str) else None)


def load(text: str, *, source: str) -> tuple[EvalItem, ...]:
    """The eval set in `text` (JSON Lines: one object per line, blank lines skipped).

    Raises EvalSetError listing every problem: bad JSON, missing or unknown keys, a prompt
    or answer of the wrong kind, an id used twice, or no question at all.
    """
    problems: list[str] = []
    items: list[EvalItem] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        item = _item(lineno, raw, problems)
        if item is None:
            continue
        if item.id is not None:
            if item.id in seen:
                problems.append(
                    f"line {lineno}: id {item.id!r} is already used on line {seen[item.id]}; "
                    "give each question its own id"
                )
                continue
            seen[item.id] = lineno
        items.append(item)
    if not items and not problems:
        problems.append(
            'no questions: add one JSON object per line, {"prompt": "...", "answer": <number>}'
        )
    if problems:
        raise EvalSetError(source, problems)
    return tuple(items)


def extract_answer(reply: str) -> Decimal | None:
    """The number a reply gives as its answer, GSM8K-style: the first number after the
    last "####" when the reply has one, else the last number in the reply; None if none.
    """
    head, mark, tail = reply.rpartition(_MARK)
    if mark:
        found = _NUMBER.search(tail)
        if found is not None:
            return Decimal(found.group().replace(",", ""))
        reply = head  # "####" with nothing after it: fall back on the rest
    numbers = _NUMBER.findall(reply)
    return Decimal(numbers[-1].replace(",", "")) if numbers else None


@dataclass(frozen=True, slots=True)
class Graded:
    """One question's outcome. `reply` None: no reply (the request failed or timed out)."""

    item: EvalItem
    reply: str | None
    got: Decimal | None
    correct: bool


def grade(item: EvalItem, reply: str | None) -> Graded:
    """A reply is right when the number it gives equals the expected one (1000 = 1,000.0);
    a reply without a number, or no reply, is wrong."""
    got = None if reply is None else extract_answer(reply)
    return Graded(item, reply, got, got is not None and got == item.answer)


@dataclass(frozen=True, slots=True)
class Score:
    """A worker's score on an eval set; `failed` (no reply) is part of `total - correct`."""

    correct: int
    total: int
    failed: int
    graded: tuple[Graded, ...]

    @property
    def wrong(self) -> tuple[Graded, ...]:
        return tuple(g for g in self.graded if not g.correct)


def score(items: Sequence[EvalItem], replies: Sequence[str | None]) -> Score:
    """Grade each reply against its item (same order); None is a request that failed."""
    if len(items) != len(replies):
        raise ValueError(f"{len(replies)} replies for {len(items)} questions; expected one each")
    graded = tuple(grade(i, r) for i, r in zip(items, replies, strict=True))
    return Score(
        correct=sum(g.correct for g in graded),
        total=len(graded),
        failed=sum(g.reply is None for g in graded),
        graded=graded,
    )


@dataclass(frozen=True, slots=True)
class EvalVerdict:
    """The eval gate's answer: passed, with its evidence in one line, and both scores
    as fractions in 0..1."""

    passed: bool
    evidence_line: str
    canary_score: float
    baseline_score: float


def _percent(x: Fraction) -> str:
    text = f"{float(x) * 100:.1f}".removesuffix(".0")
    return f"{text} %"


def eval_verdict(
    canary_correct: int,
    baseline_correct: int,
    total: int,
    tolerance: float,
    *,
    canary_failed: int = 0,
    baseline_failed: int = 0,
) -> EvalVerdict:
    """Fail the canary when its score is below the baseline's by more than `tolerance`
    (an absolute fraction: 0.05 allows 1 answer in 20 to be lost). A drop of exactly the
    tolerance passes; a canary better than the baseline always passes. `*_failed` (requests
    that got no reply, already counted wrong) only show in the evidence.

    Both sides wrong on everything passes: the gate asks whether the change made answers
    worse, and it did not; the evidence says that the set then tells nothing.
    """
    if total <= 0:
        raise ValueError(f"total must be at least 1, got {total}")
    for name, n in (("canary_correct", canary_correct), ("baseline_correct", baseline_correct)):
        if not 0 <= n <= total:
            raise ValueError(f"{name} must be in 0..{total}, got {n}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")
    canary, baseline = Fraction(canary_correct, total), Fraction(baseline_correct, total)
    # str(): 0.05 is exactly 1/20, so losing 1 of 20 answers at tolerance 0.05 passes.
    passed = baseline - canary <= Fraction(str(tolerance))

    def side(name: str, correct: int, failed: int, frac: Fraction) -> str:
        errs = f"; {failed} request{'s' if failed != 1 else ''} failed" if failed else ""
        return f"{name} {correct}/{total} ({_percent(frac)}{errs})"

    line = (
        f"eval: {side('canary', canary_correct, canary_failed, canary)} vs "
        f"{side('baseline', baseline_correct, baseline_failed, baseline)}, "
        f"tolerance {_percent(Fraction(str(tolerance)))}"
    )
    if not passed:
        points = _percent(baseline - canary).removesuffix(" %")
        line += f": failed, the canary {points} points below"
    elif baseline_correct == 0:
        line += ": passed, but the baseline answers none right: the set tells nothing here"
    else:
        line += ": passed"
    return EvalVerdict(passed, line, float(canary), float(baseline))
