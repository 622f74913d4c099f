"""canary.evalset, what test_canary_evalset.py left unheld (issue 27's mutation run over
the canary's core): a refused line is no question (its id is not taken), and a set of one
question can be judged."""

from __future__ import annotations

import pytest

from sglang_farm.canary.evalset import EvalSetError, eval_verdict, load


def test_a_line_refused_for_its_prompt_takes_no_id_and_is_one_problem() -> None:
    text = (
        '{"prompt": "", "answer": 1, "id": "a"}\n'
        '{"prompt": 5, "answer": 1, "id": "b"}\n'
        '{"prompt": "fine", "answer": 2, "id": "a"}\n'
        '{"prompt": "fine too", "answer": 3, "id": "b"}\n'
    )
    with pytest.raises(EvalSetError) as caught:
        load(text, source="e.jsonl")
    assert caught.value.problems == (
        "line 1: prompt: expected a non-empty string, got ''",
        "line 2: prompt: expected a non-empty string, got 5",
    )


def test_a_line_refused_for_its_id_is_one_problem_and_takes_no_id() -> None:
    text = '{"prompt": "q", "answer": 1, "id": ""}\n{"prompt": "r", "answer": 2, "id": ""}\n'
    with pytest.raises(EvalSetError) as caught:
        load(text, source="e.jsonl")
    assert caught.value.problems == (
        "line 1: id: expected a non-empty string, got ''",
        "line 2: id: expected a non-empty string, got ''",
    )


def test_a_set_of_one_question_is_judged() -> None:
    assert eval_verdict(1, 1, 1, 0.05).passed
    assert not eval_verdict(0, 1, 1, 0.05).passed
