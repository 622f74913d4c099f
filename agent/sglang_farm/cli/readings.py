"""Pure: a worker's readings as `farmctl status` and `why` show them, from the status
JSON: its recent 5xx share from SGLang's own counter (`recent_5xx`, issue 34 §2) and its
GPUs' NUMA nodes (`numa_nodes`, issue 34 §5)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _pct(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"


def errors_cell(recent: Mapping[str, Any] | None) -> str:
    """`1.2% of 480`: the 5xx share of the answers over the recent polls; `0 answered`
    when there was none; `-` when not known (no counter: SGLang before 0.5.20)."""
    if not isinstance(recent, Mapping):
        return "-"
    ratio = recent.get("ratio")
    answered = float(recent.get("answered") or 0)
    if not isinstance(ratio, int | float):
        return "0 answered"
    return f"{_pct(float(ratio))} of {answered:g}"


def errors_line(recent: Mapping[str, Any]) -> str:
    """`why`'s line on the worker's recent 5xx."""
    answered = float(recent.get("answered") or 0)
    errors = float(recent.get("server_errors") or 0)
    seconds = float(recent.get("seconds") or 0)
    ratio = recent.get("ratio")
    share = f" ({_pct(float(ratio))})" if isinstance(ratio, int | float) else ""
    return (
        f"5xx: {errors:g} of {answered:g} answers on its serving routes{share} over the last "
        f"{seconds:.0f} s, as its SGLang counts them (sglang:http_responses_total)"
    )


def numa_line(gpus: Sequence[int], nodes: Sequence[int]) -> str:
    """`why`'s line on the NUMA node of each of the worker's GPUs."""
    many = len(gpus) > 1
    which = ", ".join(f"GPU {g}: node {n}" for g, n in zip(gpus, nodes, strict=False))
    where = which if many else f"node {nodes[0]} (GPU {gpus[0]}'s PCI device)"
    return (
        f"NUMA {where}; SGLang binds the worker's scheduler{'s' if many else ''} there by "
        "itself: sglang-farm doctor says whether it can"
    )
