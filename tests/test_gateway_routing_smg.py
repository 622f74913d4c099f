"""smg's routing opinions against the real smg 1.13 (issue 34 §3): every flag the farm
renders from `[gateway]` starts it, and its overload protection does what the farm's
status says it does: a worker with a long queue, still listed `ready`, gets no new
request while a sibling has room, and `gateway.routing.overloaded` reads it from smg's
own worker list; with `overload_protection = false` the same worker is routed to.

Two simulators: A with room for 2 running requests (the rest queue), B unbounded.
Requests sent straight to A fill its queue, as another gateway's or a batch's would.
smg polls loads every `--load-monitor-interval` (10 s by default; 1 s here, so the test
waits less). Every wait has a deadline far above the expected time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from farmproc import free_port_block
from sglang_farm.gateway import routing
from sglang_farm.gateway.managed import ManagedGateway, smg_argv
from sglang_farm.gateway.smg import SmgGateway
from sglang_farm.spec import GatewayRouting
from smgsims import MODEL, Sim, kill_group, needs_smg, stop_sim, wait_http

pytestmark = [pytest.mark.slow, needs_smg]

ADMIN_KEY = "test-admin-key-routing"
TOKEN_S = 0.05  # the simulator's time per token: a 200-token request runs 10 s


def start_sim(port: int, extra: Sequence[str] = ()) -> Sim:
    env = {
        **os.environ,
        "SGLANG_SIM_LOAD_SECONDS": "0.2",
        "SGLANG_SIM_WARMUP_SECONDS": "0.1",
        "SGLANG_SIM_HEALTH_DELAY": "0.05",
        "SGLANG_SIM_TOKEN_SECONDS": str(TOKEN_S),
    }
    argv = [sys.executable, "-m", "sglang_farm.sim", "--model-path", MODEL, "--enable-metrics"]
    argv += ["--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    sim = Sim(port, proc)
    sim.reader = threading.Thread(target=sim.read, daemon=True)
    sim.reader.start()
    return sim


@contextlib.contextmanager
def gateway(tmp: Path, port: int, r: GatewayRouting, extra: Sequence[str] = ()) -> Iterator[str]:
    spec = ManagedGateway(
        host="127.0.0.1",
        port=port,
        metrics_port=port + 1,
        policy="round_robin",
        routing=r,
        extra_args=tuple(extra),
    )
    (tmp / "admin.key").write_text(ADMIN_KEY + "\n")
    launcher = [sys.executable, "-m", "sglang_farm.gateway.launch"]
    argv = smg_argv(spec, smg=[*launcher, "--admin-key-file", str(tmp / "admin.key")])
    log = tmp / f"smg-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"{spec.url}/health", 30, f"smg with {argv[argv.index('launch') :]}", log)
        yield spec.url
    finally:
        kill_group(proc)


def test_smg_starts_with_every_flag_the_farm_renders(tmp_path: Path) -> None:
    """Non-default values for all eleven keys: smg 1.13 takes each rendered flag."""
    r = GatewayRouting(
        overload_waiting_requests=16,
        overload_token_usage=0.9,
        overload_shed=True,
        stall_secs=4,
        wedge_secs=10,
        stale_secs=0,
        warmup_secs=30,
        warmup_blocks=256,
        warmup_share=0.5,
        priority_scheduler=True,
    )
    port = free_port_block(2)
    with gateway(tmp_path, port, r) as url:
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    port = free_port_block(2)
    with gateway(tmp_path, port, replace(GatewayRouting(), overload_protection=False)) as url:
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def _chat(url: str, max_tokens: int) -> int:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
        },
        timeout=120,
    )
    return r.status_code


def _fill(url: str, max_tokens: int) -> None:
    """One long request; the simulator is killed under it at the end of the test."""
    with contextlib.suppress(httpx.HTTPError):
        _chat(url, max_tokens)


def routed_counts(url: str) -> dict[str, float]:
    """smg's own count of requests it routed to each worker (`smg_worker_requests_total`)."""
    port = int(url.rsplit(":", 1)[1]) + 1
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("smg_worker_requests_total{"):
            continue
        labels, _, value = line.rpartition(" ")
        for part in labels[labels.index("{") + 1 : -1].split(","):
            k, _, v = part.partition("=")
            if k.strip() in ("worker", "url", "worker_url"):
                w = v.strip('"').rstrip("/")
                out[w] = out.get(w, 0.0) + float(value)
    return out


@pytest.mark.parametrize("protection", [True, False], ids=["protection_on", "protection_off"])
async def test_a_worker_past_the_queue_threshold_is_listed_ready_but_not_routed(
    tmp_path: Path, protection: bool
) -> None:
    base = free_port_block(4)
    a = start_sim(base, ["--max-running-requests", "2"])
    b = start_sim(base + 1)
    fill: list[threading.Thread] = []
    try:
        for s in (a, b):
            wait_http(f"{s.url}/health", 30, f"simulator on {s.port}", s.tail)
        r = replace(GatewayRouting(), overload_protection=protection)
        with gateway(tmp_path, base + 2, r, ["--load-monitor-interval", "1"]) as url:
            async with SmgGateway(url, api_key=ADMIN_KEY, add_timeout=30) as gw:
                await gw.add(a.url)
                await gw.add(b.url)
                # 2 running and 10 queued on A, each 200 tokens (10 s), sent past the gateway.
                fill = [
                    threading.Thread(target=_fill, args=(a.url, 200), daemon=True)
                    for _ in range(12)
                ]
                for t in fill:
                    t.start()
                end = time.monotonic() + 30
                while True:
                    m = next(m for m in await gw.list() if m.url == a.url)
                    if m.waiting is not None and m.waiting >= 8:
                        break
                    assert time.monotonic() < end, f"smg never saw A's queue: {m}"
                    await asyncio.sleep(0.2)
                assert m.routed, m  # listed ready: the farm counts it in the gateway
                assert routing.overloaded(m.waiting, m.token_usage, r) is protection
                before = routed_counts(url)
                # Counted as smg routes them (not as they are answered: one routed to A
                # waits behind its queue), sent at once.
                for _ in range(10):
                    threading.Thread(target=_fill, args=(url, 1), daemon=True).start()

                def routed() -> tuple[float, float]:
                    after = routed_counts(url)
                    return (
                        after.get(a.url, 0) - before.get(a.url, 0),
                        after.get(b.url, 0) - before.get(b.url, 0),
                    )

                end = time.monotonic() + 60
                while sum(routed()) < 10:
                    assert time.monotonic() < end, f"smg routed {routed()} of 10 requests"
                    await asyncio.sleep(0.1)
                to_a, to_b = routed()
                if protection:
                    assert (to_a, to_b) == (0, 10)
                else:
                    assert to_a > 0 and to_a + to_b == 10  # round robin: about half to A
    finally:
        stop_sim(a)  # its fill requests end with it
        stop_sim(b)
        for t in fill:
            t.join(timeout=10)
