"""I/O: the doctor's last report, kept for the agent: the launch gate's preflight.

A worker with a blocking failure is not started, and its failure (with the fix) becomes
its last failure. Gathered at start and again at each reload and operator's start
(`DoctorReportCache.refresh`, in a thread); `service` builds it, the agent asks it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import structlog

from sglang_farm.doctor.checks import DoctorReport
from sglang_farm.gpus.snapshot import GpuPoller
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.spec import FarmSpec

# The service's name: these lines were the service's before the cache had a module.
log = structlog.get_logger("sglang_farm.service")


class DoctorReportCache:
    """The doctor's last report and the GPUs' compute capabilities, kept for the agent: a
    worker with a blocking failure is not started, and its failure (with the fix) becomes
    the worker's last failure, so `farmctl why N` says exactly what to repair
    (`sglang-farm doctor` prints the same).

    Gathered at start, and again at each reload and operator's start (`refresh`): a fixed
    model path or a new flag is judged anew, never by the start's report. What is judged
    is what each worker runs (`worker_commands`, at the step `oom_steps` says).
    """

    def __init__(
        self,
        poller: GpuPoller | None,
        *,
        gateway_python: str | None = None,
        oom_steps: Callable[[], Mapping[int, int]] = dict,
    ) -> None:
        from sglang_farm.gpus.simulated import FakeGpuPoller

        self._source: GpuPoller = poller or FakeGpuPoller(count=0)
        self._gateway_python = gateway_python  # None: the agent's own (tests: one without smg)
        self._oom_steps = oom_steps
        self._said_gateway: str | None = None
        self._report: DoctorReport | None = None
        self.compute_caps: dict[int, tuple[int, int]] = {}

    @property
    def report(self) -> DoctorReport | None:
        """The last report: None before the first refresh, or after the doctor crashed."""
        return self._report

    def gpu_numa_nodes(self) -> Mapping[int, int]:
        """Each GPU's NUMA node as the last report read it (issue 34 §5: `farmctl status`
        and `why` show each worker's); empty on a host of one node or before a report."""
        return self._report.gpu_numa_nodes() if self._report is not None else {}

    async def refresh(self, spec: FarmSpec) -> None:
        from sglang_farm.doctor import run_doctor
        from sglang_farm.sglang.commands import at_ladder_steps, worker_commands

        try:
            fleet = await asyncio.to_thread(self._source.snapshot)
            caps = {g.index: g.compute_capability for g in fleet.gpus if g.compute_capability}
            steps = self._oom_steps()
            report = await asyncio.to_thread(
                run_doctor,
                at_ladder_steps(spec, steps),  # the flags the rules judge: as they will run
                self._source,
                gateway_python=self._gateway_python,
                commands=worker_commands(spec, steps, caps),
            )
        except Exception as exc:  # a doctor bug must not keep a valid farm from starting
            log.error("preflight_crashed", error=repr(exc))
            self._report = None
            return
        self._report = report
        self.compute_caps.clear()
        self.compute_caps.update(caps)
        log.info(
            "preflight_done",
            **{str(k): v for k, v in report.counts().items()},
            # Issue 31: each warning named where it is counted ("warn": 1 said not which).
            warnings=report.warnings(),
        )
        self._say_failed(report)
        self._say_gateway(report)

    @staticmethod
    def _say_failed(report: DoctorReport) -> None:
        """Each failed check by name, where the counts are said: the log is where an
        operator looks first (the gateway's own is said once by `_say_gateway`)."""
        from sglang_farm.doctor.checks import CheckId, Status

        for c in report.checks:
            if c.status is Status.FAIL and c.id is not CheckId.GATEWAY:
                log.error(
                    "preflight_failed",
                    check=str(c.id),
                    workers=list(c.workers),
                    message=c.message,
                    fix=c.fix,
                )

    def _say_gateway(self, report: DoctorReport) -> None:
        """A managed gateway that cannot run (smg missing) is said once, with the fix; the
        gateway's runner keeps trying with back-off (runtime/gateway_child)."""
        from sglang_farm.doctor.checks import CheckId, Status

        failed = next(
            (c for c in report.checks if c.id is CheckId.GATEWAY and c.status is Status.FAIL), None
        )
        if failed is not None and failed.message != self._said_gateway:
            log.error("gateway_unavailable", problem=failed.message, fix=failed.fix)
        self._said_gateway = failed.message if failed is not None else None

    def blocking(self, spec: FarmSpec, worker: int) -> list[Failure]:
        from sglang_farm.doctor import preflight_blocking

        if self._report is None or worker not in spec.worker_ids:
            return []
        checks = preflight_blocking(spec, worker, self._report, port_check=lambda _h, _p: None)
        return [
            Failure(FailureKind.PREFLIGHT, f"preflight {c.id}: {c.message}", c.fix, ())
            for c in checks
        ]
