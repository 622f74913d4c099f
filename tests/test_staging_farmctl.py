"""farmctl and a model stage (issue 16): status's model line, `why N` for a worker a failed
stage holds, `start` staging again and failing with the reason; over a real socket."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fake_ops import FakeOps
from ops_socket import serving
from sglang_farm.farm_view import FarmView, Phase
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.state import StageState, StagingView
from sglang_farm.workers.supervisor import Rollout

FAILED = StagingView(
    source="/srv/models/Qwen3.6-27B",
    target="/dev/shm/Qwen3.6-27B",
    state=StageState.FAILED,
    since=1.8e9,
    error="not enough space for /srv/models/Qwen3.6-27B at /dev/shm/Qwen3.6-27B: 3.0 GiB short",
    error_kind="no_space",
    fix="grow it by at least 3.0 GiB: `mount -o remount,size=66000M /dev/shm`",
)


class StagingOps(FakeOps):
    def __init__(self, staging: StagingView) -> None:
        super().__init__(4)
        self.staging = staging
        for i, w in self.workers.items():
            self.workers[i] = replace(w, phase=Phase.STOPPED, pid=None)

    def view(self) -> FarmView:
        return replace(super().view(), rollout=Rollout.IDLE, staging=self.staging)

    async def start(self, worker_ids: Sequence[int]) -> None:
        if self.staging.state == "failed":
            s = self.staging
            raise StageError(StageFailureKind.NO_SPACE, s.error or "", s.fix or "")
        await super().start(worker_ids)


def test_status_why_and_start_with_a_failed_stage() -> None:
    with serving(StagingOps(FAILED)) as agent:
        r = agent.run("status")
        assert r.exit_code == 0, r.output
        line = r.output.splitlines()[1]
        assert line.startswith(
            "model /srv/models/Qwen3.6-27B -> /dev/shm/Qwen3.6-27B · staging FAILED [no_space]: "
            "not enough space"
        )
        assert "what to do: grow it by at least 3.0 GiB" in line
        r = agent.run("why", "1")
        assert r.exit_code == 0, r.output
        out = r.output.splitlines()
        assert out[0] == "worker 1: stopped"
        assert out[1].startswith("not started: the model could not be staged into /dev/shm/")
        assert "3.0 GiB short" in out[1] and "What to do: grow it" in out[1]
        assert "no failure recorded" not in r.output
        r = agent.run("start", "all")
        assert r.exit_code == 1
        assert "not started: the model could not be staged: not enough space" in r.output
        assert agent.ops.calls == []


def test_why_shows_the_progress_of_a_stage_under_way() -> None:
    staging = replace(
        FAILED,
        state=StageState.STAGING,
        step="copying",
        bytes_done=1 << 30,
        bytes_total=4 << 30,
        rate=float(1 << 29),
        eta_s=6.0,
        error=None,
        error_kind=None,
        fix=None,
    )
    with serving(StagingOps(staging)) as agent:
        r = agent.run("why", "2")
        assert r.exit_code == 0, r.output
        assert "waiting for the model to be staged into /dev/shm/Qwen3.6-27B" in r.output
        assert "staging: copying 1.0 GiB of 4.0 GiB (25%) at 512.0 MiB/s, about 6s left" in r.output
