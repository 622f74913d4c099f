"""I/O: the readiness gate `sglang-farm wait-ready N`, run as a worker unit's ExecStartPost=.

systemd keeps a unit `activating` until its ExecStartPost= commands have exited, and
fails the start if one fails or the unit's TimeoutStartSec= passes. So a gate that
returns only once the worker's `/health` answers 200 makes systemd's own view tell the
truth: `systemctl is-active sglang@3` says `activating` while the model loads and
`active` once the worker can serve, and `systemctl start sglang@3` returns then.

The gate polls the worker's readiness route (`/ready` where SGLang has it, then `[health]
path` once `/ready` answers 404: `sglang/ready_route`; the drop-ins pass both `--url`s in
that order) with the `[health] timeout` per request (SGLang's
/health can take up to 20 s server-side), every `[startup] poll_interval`, until
the deadline (`[startup] load_timeout`, the same value the unit's TimeoutStartSec=
holds). Connection refused is normal meanwhile: SGLang binds its port only after the
full model load. The rendered drop-ins pass all of that on the gate's command line
(`--url`, `--timeout`, `--probe-timeout`, `--interval`), rendered from the config the
agent loaded, so the gate never reads farm.toml: a half-edited, unreloaded file cannot
break a restart or make it probe the wrong port. `--config` is for a person's use.

With `--main-pid` (as the drop-ins run it), a 200 counts only when the socket listening
on the port is held by the worker's own processes (the main process's session, group and
descendants: `portowner`): SGLang binds its port only after loading, and whatever another
user bound there first must not turn the unit `active` (the agent stops such a worker
with `port_taken`, docs/security.md).

Exit status (`WaitExit`): 0 ready, 1 not ready by the deadline, 2 bad config or
unknown worker. If the worker's main process dies while loading, systemd stops the
unit and kills the gate itself. The command's options are in `cli/waitready.py`.
"""

from __future__ import annotations

import asyncio
import time
from enum import IntEnum
from urllib.parse import urlsplit

import httpx
import structlog

from sglang_farm.host import procfs
from sglang_farm.host.listeners import OwnerKind, connect_host
from sglang_farm.host.portowner import ProcPortOwner, tree_pids
from sglang_farm.sglang.health import probe
from sglang_farm.sglang.ready_route import next_route, readiness_routes
from sglang_farm.spec import FarmSpec

log = structlog.get_logger("sglang_farm.runtime.waitready")


class WaitExit(IntEnum):
    READY = 0
    NOT_READY = 1
    USAGE = 2


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    st = procfs.read_stat(pid)
    return st is not None and st.alive


async def _wait(
    urls: tuple[str, ...],
    timeout: float,
    interval: float,
    budget: float,
    main_pid: int | None = None,
) -> tuple[bool, str]:
    """Poll `urls[0]` until 200 or `budget` seconds pass, moving to the next URL when one
    answers 404 (a SGLang without that route); returns (ready, last detail).

    With `main_pid`, give up as soon as that process is gone: on systemd 252 a unit whose
    main process dies during ExecStartPost= stays `activating` until the gate returns, so a
    worker that crashed while loading would otherwise hold its unit for the whole deadline.
    And a 200 counts only when the listener is that process tree's own (`_own_listener`).
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + budget
    last = "not probed"
    at = 0
    # trust_env=False: an HTTP(S)_PROXY in the unit's environment must not catch loopback.
    async with httpx.AsyncClient(trust_env=False) as client:
        while True:
            left = end - loop.time()
            if left <= 0:
                return False, last
            if main_pid is not None and not pid_alive(main_pid):
                return False, f"main process {main_pid} exited"
            url = urls[at]
            result = await probe(client, url, min(timeout, left))
            moved = next_route(urls, at, result.status)
            if moved != at:
                log.info("wait_ready_route", url=urls[moved], why=f"{url} answered 404")
                at = moved
                continue
            if result.ok and main_pid is None:
                return True, result.detail
            if result.ok and main_pid is not None:
                verdict = await _own_listener(url, main_pid)
                if verdict is None:
                    return True, result.detail
                if verdict != last:
                    log.warning("wait_ready_port_not_ours", url=url, detail=verdict)
                last = verdict
            else:
                last = result.detail
            pause = min(interval, end - loop.time())
            if pause <= 0:
                return False, last
            await asyncio.sleep(pause)


async def _own_listener(url: str, main_pid: int) -> str | None:
    """None when the listener `url` reaches is held by `main_pid`'s processes, else why not."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80

    async def ours() -> frozenset[int]:
        return await asyncio.to_thread(tree_pids, main_pid)

    own = await ProcPortOwner().check(connect_host(host), port, ours)
    if own.kind is OwnerKind.OURS:
        return None
    if own.kind is OwnerKind.FOREIGN:
        return f"port {port} is held by {own.holder()}, not by this worker"
    return f"port {port}: the listener is {own.kind}, not proven this worker's"


def wait_url(
    worker_id: int,
    urls: tuple[str, ...],
    *,
    deadline: float,
    probe_timeout: float,
    interval: float,
    main_pid: int | None = None,
) -> int:
    """Block until the first of `urls` that the worker serves answers 200, at most
    `deadline` seconds; returns a `WaitExit` value.

    What the rendered drop-ins run: the URL and every timeout come from the unit's own
    command line, so the gate never reads farm.toml (a half-edited file must not change
    what a restart probes).
    """
    t0 = time.monotonic()
    url = " then ".join(urls)
    log.info("wait_ready_start", worker=worker_id, url=url, deadline_s=deadline)
    ready, detail = asyncio.run(_wait(urls, probe_timeout, interval, deadline, main_pid))
    after = round(time.monotonic() - t0, 3)
    if ready:
        log.info("wait_ready_ok", worker=worker_id, url=url, after_s=after)
        return WaitExit.READY
    log.error("wait_ready_timeout", worker=worker_id, url=url, after_s=after, last=detail)
    return WaitExit.NOT_READY


def wait_ready(spec: FarmSpec, worker_id: int, deadline: float, main_pid: int | None = None) -> int:
    """Block until worker `worker_id`'s health endpoint (from `spec`) answers 200, at most
    `deadline` seconds.

    Returns a `WaitExit` value (0 ready, 1 not ready in time, 2 no such worker).
    """
    try:
        worker = spec.worker(worker_id)
    except KeyError:
        ids = ", ".join(str(i) for i in spec.worker_ids) or "none"
        log.error("wait_ready_unknown_worker", worker=worker_id, config=spec.source, workers=ids)
        return WaitExit.USAGE
    return wait_url(
        worker_id,
        tuple(
            worker.base_url + r for r in readiness_routes(spec.health.ready_path, spec.health.path)
        ),
        deadline=deadline,
        probe_timeout=spec.health.timeout,
        interval=spec.startup.poll_interval,
        main_pid=main_pid,
    )
