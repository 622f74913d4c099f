"""Farm views built by hand (a worker in each phase, a failure): the control results' tests
and those of the texts built from them share them.
"""

from __future__ import annotations

from sglang_farm.farm_view import (
    FarmView,
    Phase,
    RestartRecord,
    WorkerView,
)
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.workers.supervisor import Rollout


def _view() -> FarmView:
    f = Failure(FailureKind.CUDA_OOM_LOAD, "OOM while loading", "lower mem fraction", ("l1", "l2"))
    w0 = WorkerView(0, (0,), 30000, "http://127.0.0.1:30000", Phase.READY, 100.0, 11)
    w1 = WorkerView(
        1,
        (1, 2),
        30001,
        "http://127.0.0.1:30001",
        Phase.FAILED,
        200.0,
        None,
        restarts=(RestartRecord(150.0, "oom"), RestartRecord(190.0, "crash")),
        restarts_by_reason={"oom": 2, "crash": 1},
        last_failure=f,
        last_failure_at=199.0,
        last_action="gave up after 5 failures",
        oom_step=2,
        oom_step_name="fewer-graphs",
    )
    return FarmView("f", "process", (w0, w1), "/etc/x.toml", 50.0, Rollout.HALTED, "canary failed")


def _worker(phase: Phase, *, in_gateway: bool, last_drain: float | None = None) -> WorkerView:
    return WorkerView(
        3,
        (3,),
        30003,
        "http://127.0.0.1:30003",
        phase,
        250.0,
        33,
        in_gateway=in_gateway,
        last_drain_seconds=last_drain,
    )
