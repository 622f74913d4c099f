"""Pure: the workers whose process loaded (or is loading) a copy of the model.

They are the ones a new copy concerns: a reload keeps the previous copy while any of them
runs, and `staging.stale` says which of them are on a copy other than the one now at
model_path.
"""

from __future__ import annotations

from collections.abc import Mapping

from sglang_farm.workers.phase_sets import LOADS_MODEL
from sglang_farm.workers.records import WorkerState


def loading(workers: Mapping[int, WorkerState]) -> list[int]:
    """The workers a new copy of the model concerns: they loaded (or load) the previous."""
    return sorted(w for w, s in workers.items() if s.phase in LOADS_MODEL)
