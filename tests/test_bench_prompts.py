"""The canary matrix's prefix-heavy prompt modes (issue 34 §1), pure."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from bench.loadgen import SYSTEM_PROMPT, SYSTEM_SHARE, messages


def _adjust(*args: Any, **kw: Any) -> Any:
    """bench.canary_matrix.adjust, imported by name (as tests/test_canary_bench.py does:
    the module reaches tests/farmproc.py as `tests.farmproc`)."""
    return importlib.import_module("bench.canary_matrix").adjust(*args, **kw)


def test_same_sends_one_prompt_and_system_shares_a_system_prompt_with_most() -> None:
    same = [messages("same", n) for n in range(50)]
    assert all(m == same[0] for m in same) and same[0][0]["content"] == SYSTEM_PROMPT
    system = [messages("system", n) for n in range(1000)]
    shared = [m for m in system if m[0]["content"] == SYSTEM_PROMPT]
    assert abs(len(shared) / 1000 - SYSTEM_SHARE) < 0.05
    assert len({m[-1]["content"] for m in shared}) > 500  # their own questions after it
    distinct = [messages("distinct", n) for n in range(100)]
    assert len({m[0]["content"] for m in distinct}) == 100
    with pytest.raises(ValueError, match="prompt mode"):
        messages("fancy", 0)


def test_adjust_sets_the_probes_and_the_prefill_cost() -> None:
    doc: dict[str, Any] = {
        "workers": {"gpus": list(range(8))},
        "startup": {"parallel": 4},
        "farm": {"env": {"A": "1"}},
    }
    _adjust(4, "20s", True, False, probes=2, prefill_s=0.001)(doc)
    assert doc["rollout"]["probe_concurrency"] == 2
    assert doc["rollout"]["analysis_window"] == "20s"
    assert doc["farm"]["env"] == {"A": "1", "SGLANG_SIM_PREFILL_TOKEN_SECONDS": "0.001"}
