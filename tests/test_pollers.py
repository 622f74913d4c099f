"""The worker pollers send a worker's API key, which SGLang's /v1/loads requires (#4)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from poller_farm import TOML
from sglang_farm.config import load_spec
from sglang_farm.sglang.argv import worker_api_key
from sglang_farm.sglang.load import WorkerSample


def test_the_poller_sends_the_key_a_worker_was_started_with() -> None:
    spec = load_spec(TOML, source="t.toml")
    assert worker_api_key(spec, 1) == "k-worker-1"
    assert worker_api_key(spec, 0) is None
    assert worker_api_key(spec, 7) is None  # not (or no longer) a worker of this farm


def test_a_poll_loop_cancelled_while_polls_wait_their_turn_leaves_no_unawaited_poll() -> None:
    """Polls are spread over the interval; the agent stopping meanwhile cancels the wait.
    A poll made before its turn would be a coroutine never awaited (a RuntimeWarning at
    garbage collection, blamed on whatever runs then)."""
    import dataclasses
    import gc
    import warnings

    from metrics_fixtures import farm
    from sglang_farm.farm_view import Phase
    from sglang_farm.metrics import pollers

    made: list[int] = []

    def poll_worker(*_args: object, worker: int, **_kw: object) -> Coroutine[Any, Any, Any]:
        made.append(worker)

        async def never() -> WorkerSample:
            await asyncio.sleep(3600)
            raise AssertionError("not reached")

        return never()

    view = farm()
    view = dataclasses.replace(
        view, workers=tuple(dataclasses.replace(w, phase=Phase.READY) for w in view.workers)
    )
    spec = load_spec(TOML, source="t.toml")

    async def scenario() -> None:
        polling = pollers.MetricPollers(lambda: spec, None, view, poll=poll_worker)
        loop = asyncio.ensure_future(polling._worker_loop())
        await asyncio.sleep(0.05)  # the first poll's turn has come; the others' (0.6 s apart) not
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        gc.collect()
    assert made == [view.workers[0].id]
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_the_pollers_follow_a_reload_workers_intervals_and_keys(tmp_path: Path) -> None:
    """Issue 32, 4.1: the pollers kept the config they started with. After a reload that
    removes workers 6 and 7, the simulated GPUs' poll raised KeyError on every poll
    (swallowed: no snapshot reached the agent's GPU-health rules again); a worker's new
    API key and the new [metrics] intervals never reached the pollers."""
    from structlog.testing import capture_logs

    from agent_harness import farm, farm_toml
    from sglang_farm.gpus.simulated import FakeGpuPoller
    from sglang_farm.gpus.snapshot import FleetSnapshot
    from sglang_farm.metrics.pollers import MetricPollers
    from sglang_farm.sglang.health import LocalHttp
    from sglang_farm.spec import FarmSpec

    def text(workers: int, gpu_interval: str, key: str | None) -> str:
        return farm_toml(
            tmp_path,
            workers=workers,
            metrics={
                "gpu_source": "fake",
                "listen": "127.0.0.1:0",
                "gpu_poll_interval": gpu_interval,
                "worker_poll_interval": "0.2s",
            },
            health={"period": "0.3s"},
            startup={"poll_interval": "100ms"},
            sglang={"api_key": key} if key else {},
        )

    texts = [text(8, "0.2s", None)]
    fleets: list[tuple[float, FleetSnapshot]] = []
    keys: list[tuple[float, int, str | None]] = []

    async def poll(
        client: LocalHttp,
        base_url: str,
        timeout: float,
        *,
        worker: int,
        known_version: str | None,
        api_key: str | None,
    ) -> WorkerSample:
        keys.append((time.monotonic(), worker, api_key))
        return WorkerSample(worker, time.time(), False, error="not polled: a test")

    def since(t0: float) -> int:
        return len([t for t, _ in fleets if t > t0])

    async def scenario() -> None:
        def loader() -> FarmSpec:
            return load_spec(texts[0], source="test.toml")

        async with farm(tmp_path, text=texts[0], loader=loader, load_s=0.2) as f:

            def on_fleet(fleet: FleetSnapshot) -> None:
                f.agent.observe_fleet(fleet)
                fleets.append((time.monotonic(), fleet))

            pollers = MetricPollers(
                lambda: f.agent.spec,
                FakeGpuPoller(count=8),
                f.agent.view(),
                on_fleet=on_fleet,
                poll=poll,
            )
            pollers_see = f.agent.view  # the harness's observers are fixed: hand views on

            async def until(cond: Callable[[], bool], what: str) -> None:
                for _ in range(600):  # a give-up bound, far above the 0.2 s intervals
                    pollers.on_view(pollers_see())
                    if cond():
                        return
                    await asyncio.sleep(0.1)
                raise AssertionError(f"not within 60 s: {what}")

            await pollers.start()
            try:
                await f.until(f.all_ready, within=60)
                # 1. Workers 6 and 7 removed: the GPU snapshots go on.
                texts[0] = text(6, "0.2s", None)
                with capture_logs() as logged:
                    await f.ops.reload()
                    await until(lambda: sorted(f.phases()) == list(range(6)), "6 workers")
                    removed = time.monotonic()
                    await until(lambda: since(removed) >= 10, "10 GPU snapshots after it")
                failed = [e for e in logged if e.get("event") == "gpu_poll_failed"]
                assert failed == [], failed[:1]
                # 2. A new key and a GPU interval of an hour: the key is sent, the
                # snapshots stop after the one under way.
                texts[0] = text(6, "1h", "k-new")
                await f.ops.reload()
                await until(lambda: f.agent.spec.metrics.gpu_poll_interval == 3600, "in force")
                applied = time.monotonic()
                await until(
                    lambda: (1, "k-new") in {(w, k) for t, w, k in keys if t > applied},
                    "worker 1 polled with its new key",
                )
                await until(f.all_ready, "6 ready")
                assert since(applied) <= 2, f"{since(applied)} GPU snapshots at a 1 h interval"
            finally:
                await pollers.close()

    asyncio.run(scenario())


def test_one_walk_of_proc_per_gpu_poll_serves_every_workers_tree() -> None:
    """Issue 32, 4.8: the GPU poll of 8 workers reads every process's parent once and
    finds all eight trees in it (a counting reader), and the simulated memory lands on
    each worker's child, as it did with a walk per worker."""
    import dataclasses

    from metrics_fixtures import farm
    from sglang_farm.gpus.simulated import FakeGpuPoller
    from sglang_farm.gpus.snapshot import FleetSnapshot
    from sglang_farm.metrics.pollers import MetricPollers

    spec = load_spec(
        TOML.replace("gpus = [0, 1]", "gpus = [0, 1, 2, 3, 4, 5, 6, 7]").replace(
            'gpu_source = "none"', 'gpu_source = "fake"\ngpu_poll_interval = "50ms"'
        ),
        source="t.toml",
    )
    template = farm().workers[0]
    view = dataclasses.replace(
        farm(),
        workers=tuple(
            dataclasses.replace(template, id=w, gpus=(w,), pid=1000 + 10 * w) for w in range(8)
        ),
    )
    # Each worker: its main process, a child (the scheduler) and a grandchild; then the
    # rest of the host.
    ppids = {1: 0, 2: 1, 999: 1}
    for w in range(8):
        main = 1000 + 10 * w
        ppids |= {main: 999, main + 1: main, main + 2: main + 1}
    reads: list[int] = []
    fleets: list[FleetSnapshot] = []

    def read_ppids() -> dict[int, int]:
        reads.append(len(fleets))
        return ppids

    async def scenario() -> MetricPollers:
        polling = MetricPollers(
            lambda: spec, None, view, on_fleet=fleets.append, read_ppids=read_ppids
        )
        loop = asyncio.ensure_future(polling._gpu_loop(FakeGpuPoller(count=8)))
        try:
            for _ in range(600):  # a give-up bound, far above 50 ms polls
                if len(fleets) >= 3:
                    break
                await asyncio.sleep(0.05)
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        return polling

    polling = asyncio.run(scenario())
    assert len(fleets) >= 3
    assert reads[: len(fleets)] == list(range(len(fleets)))  # one read per poll, before it
    trees = polling.state().worker_pids
    assert dict(trees) == {w: frozenset(1000 + 10 * w + k for k in range(3)) for w in range(8)}
    held = {g.index: {p.pid for p in g.processes} for g in fleets[-1].gpus}
    assert held == {w: {1000 + 10 * w + 1} for w in range(8)}
