"""I/O: the composition root of `sglang-farm-batch`: read the farm's config, open the
store, and serve the API and the runner in one event loop until SIGTERM.

`sglang-farm-batch --config /etc/sglang-farm/farm.toml` (or `python -m sglang_farm.batch`).
It refuses to start without `[batch] enabled = true` and a readable, non-empty
`api_key_file`; with the embedded store it takes `<state_dir>/batch.lock` so that two
services never share one SQLite file.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import prometheus_client
import structlog
import uvicorn

from sglang_farm import logsetup
from sglang_farm.batch import capacity
from sglang_farm.batch.api import BatchApi
from sglang_farm.batch.farmstatus import FarmStatus
from sglang_farm.batch.metrics import BatchMetrics
from sglang_farm.batch.objects import new_id
from sglang_farm.batch.runner import Runner, RunnerSettings, frontdoors
from sglang_farm.batch.store import BatchRow, Store, StoreError
from sglang_farm.batch.validate import check_line
from sglang_farm.config import load_spec_file
from sglang_farm.errors import ConfigError
from sglang_farm.host.paths import DEFAULT_CONFIG_PATH
from sglang_farm.spec import FarmSpec

log = structlog.get_logger("sglang_farm.batch")


class StartError(Exception):
    """Why the service does not start: what, where, what to do."""


def read_key(path: str, what: str) -> str:
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise StartError(
            f"cannot read {what} {path}: {exc.strerror or exc}; write the key there (readable by "
            "the batch service only)"
        ) from exc
    if not key:
        raise StartError(f"{what} {path} is empty; write the key there")
    return key


def private_dir(path: str) -> Path:
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(p, 0o700)
    return p


def owner_id(state_dir: Path) -> str:
    """This service's name in the store, kept across restarts (what it held in flight when
    it died is its own to send again at once)."""
    path = state_dir / "owner"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    name = f"{socket.gethostname()}-{new_id('')[:8]}"
    tmp = state_dir / "owner.part"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return name


def open_store(url: str, state_dir: Path) -> Store:
    if url == "sqlite":
        from sglang_farm.batch.sqlite import SqliteStore

        lock = os.open(state_dir / "batch.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StartError(
                f"another batch service holds {state_dir}/batch.db; stop it, or give this one "
                "its own [batch] state_dir (or a shared PostgreSQL store)"
            ) from None
        return SqliteStore(str(state_dir / "batch.db"))  # the lock fd lives as long as we do
    from sglang_farm.batch.postgres import PostgresStore

    return PostgresStore(url)


def settings_for(spec: FarmSpec, owner: str) -> RunnerSettings:
    b = spec.batch
    g = spec.gateway
    doors = frontdoors(
        g.mode,
        str(g.listen).replace("0.0.0.0", "127.0.0.1"),
        g.external_urls,
        [w.base_url for w in spec.workers],
    )
    max_running = {
        w.id: int(v)
        for w in spec.workers
        if isinstance(v := w.flags.get("max_running_requests"), int)
    }
    headers = dict(b.headers)
    key_file = b.gateway_key_file or g.api_key_file
    if key_file is not None:
        try:
            headers["Authorization"] = f"Bearer {read_key(key_file, 'the front door key')}"
        except StartError:
            if b.gateway_key_file is not None:
                raise
            log.warning(
                "batch_no_gateway_key",
                file=key_file,
                fix="set [batch] gateway_key_file to a key this service may read",
            )
    return RunnerSettings(
        frontdoors=doors,
        owner=owner,
        max_attempts=b.max_attempts,
        retry_backoff_s=b.retry_backoff_s,
        request_timeout_s=b.request_timeout_s,
        concurrency=b.concurrency,
        max_running=max_running,
        config_slots=sum(max_running.get(w.id, capacity.DEFAULT_MAX_RUNNING) for w in spec.workers),
        headers=headers,
        gateway=g.enabled,
    )


async def serve(spec: FarmSpec) -> int:
    b = spec.batch
    if not b.enabled:
        raise StartError(
            f"{spec.source}: [batch] enabled is false; set enabled = true (and api_key_file) "
            "to run the batch service"
        )
    assert b.api_key_file is not None
    api_key = read_key(b.api_key_file, "[batch] api_key_file")
    state = private_dir(b.state_dir)
    files = private_dir(str(state / "files"))
    store = open_store(b.store, state)
    owner = owner_id(state)
    metrics = BatchMetrics()
    settings = settings_for(spec, owner)

    def load_batch(batch: BatchRow) -> None:
        path = files / f"{batch.input_file_id}.jsonl"
        now = asyncio_time()
        try:
            with path.open("rb") as f:
                problems = store.load(
                    batch.id,
                    (
                        got
                        for n, raw in enumerate(f, start=1)
                        if (got := check_line(n, raw, batch.endpoint)) is not None
                    ),
                    now=now,
                )
        except FileNotFoundError:
            from sglang_farm.batch.validate import Problem

            problems = store.load(
                batch.id,
                iter(
                    [
                        [
                            Problem(
                                None, "input_file_id", "the input file's bytes are not on this host"
                            )
                        ]
                    ]
                ),
                now=now,
            )
        log.info("batch_validated", batch=batch.id, problems=len(problems))

    async def validate(batch: BatchRow) -> None:
        await asyncio.to_thread(load_batch, batch)

    runner = Runner(
        store, settings, metrics, farm=FarmStatus(spec.control.socket), validate=validate
    )
    api = BatchApi(
        store, str(files), api_key, metrics, wake=runner.wake, paused=lambda: runner.paused
    )
    config = uvicorn.Config(
        api.app,
        host=b.listen.host,
        port=b.listen.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    log.info(
        "batch_service_started",
        listen=str(b.listen),
        store="sqlite" if b.store == "sqlite" else "postgresql",
        frontdoors=list(settings.frontdoors),
        owner=owner,
    )
    task = asyncio.create_task(runner.run())
    try:
        await server.serve()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        store.close()
    return 0


def asyncio_time() -> float:
    import time

    return time.time()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sglang-farm-batch",
        description="The farm's batch service: OpenAI's Files and Batches API (docs/batch.md)",
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG_PATH, help="the farm's TOML")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logsetup.configure(args.log_level)
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created
    try:
        from sglang_farm.gpus.nvml import gpu_count_for_config

        spec = load_spec_file(args.config, gpu_count=gpu_count_for_config(args.config))
        return asyncio.run(serve(spec))
    except ConfigError as exc:
        print(f"sglang-farm-batch: {exc}", file=sys.stderr)
        return 2
    except (StartError, StoreError) as exc:
        print(f"sglang-farm-batch: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
