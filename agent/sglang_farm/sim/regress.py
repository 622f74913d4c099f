"""Pure: the regressions the simulator can be told to have while it serves, so that a
canary analysis (docs/canary.md) can be tested against each: a fraction of requests
answered HTTP 500 (SGLANG_SIM_ERROR_RATE), and wrong answers to arithmetic prompts
(SGLANG_SIM_WRONG_RATE). Slow tokens (SGLANG_SIM_TOKEN_SECONDS) and a crash while
serving (SGLANG_SIM_FAIL_AFTER) exist elsewhere.

Every choice is a function of SGLANG_SIM_SEED and a key (the request's number for
errors, the question for answers), never of a random generator's state, so a run is
reproducible: the same seed errs on the same requests of a sequence, and answers the same
question wrong every time (an eval set's score is the same on every run).

Arithmetic mode needs no switch: a prompt that asks "What is A + B?" (integers; the
last such question in the prompt) is answered with the sum, or at SGLANG_SIM_WRONG_RATE
with a sum that is off by 1 to 9; any other prompt gets the usual " sim" tokens.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_QUESTION = re.compile(r"what\s+is\s+(-?\d{1,18})\s*\+\s*(-?\d{1,18})\s*\?", re.IGNORECASE)

# The body SGLang's OpenAI routes answer an internal error with (`create_error_response`:
# object "error", the message, type "InternalServerError", code 500).
ERROR_MESSAGE = "Internal server error (simulated by SGLANG_SIM_ERROR_RATE)"


def draw(seed: int, kind: str, key: str) -> float:
    """A number in [0, 1) fixed by (seed, kind, key): sha256, its first 8 bytes."""
    digest = hashlib.sha256(f"{seed}\0{kind}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def errs(seed: int, rate: float, request_number: int) -> bool:
    """Whether the request numbered `request_number` (from 1, in arrival order) gets a 500."""
    return rate > 0 and draw(seed, "error", str(request_number)) < rate


@dataclass(frozen=True, slots=True)
class Question:
    """ "What is A + B?" found in a prompt."""

    a: int
    b: int

    @property
    def key(self) -> str:
        return f"{self.a}+{self.b}"


def find_question(prompt: str) -> Question | None:
    """The last "What is A + B?" in `prompt` (case and spacing free), or None."""
    found = _QUESTION.findall(prompt)
    if not found:
        return None
    a, b = found[-1]
    return Question(int(a), int(b))


def answer(question: Question, seed: int, wrong_rate: float) -> str:
    """The reply's text: the sum, or (at `wrong_rate`, fixed per question) the sum off by 1..9."""
    total = question.a + question.b
    if wrong_rate > 0 and draw(seed, "wrong", question.key) < wrong_rate:
        off = 1 + int(draw(seed, "offset", question.key) * 9)
        return str(total + off)
    return str(total)
