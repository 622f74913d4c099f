"""The gateway seam: `SmgGateway` against the real smg, `FakeGateway` against the same contract.

The slow tests start one smg (`smg launch`, its argv built by `gateway.managed`) and
three simulators on a free block of ports, and watch the simulators' access logs to
see which worker the gateway sent each request to. They are skipped only when smg is
not installed (`pip install smg`; scripts/setup installs it). Every wait has a
deadline; the module takes about 15 s.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from fake_gateway import FakeGateway
from farmproc import free_port_block
from sglang_farm.gateway import Gateway, GatewayError, GatewayErrorCode
from sglang_farm.gateway.launch import smg_args
from sglang_farm.gateway.managed import ManagedGateway, problems, smg_argv
from sglang_farm.gateway.smg import SmgGateway
from smgsims import MODEL, Sim, kill_group, needs_smg, stop_sim, wait_http

ADMIN_KEY = "test-admin-key"


# -- processes -----------------------------------------------------------------------------


def start_sim(port: int) -> Sim:
    env = {
        **os.environ,
        "SGLANG_SIM_LOAD_SECONDS": "0.2",
        "SGLANG_SIM_WARMUP_SECONDS": "0.1",
        "SGLANG_SIM_HEALTH_DELAY": "0.05",
    }
    argv = [sys.executable, "-m", "sglang_farm.sim", "--model-path", MODEL]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its scheduler children share its process group
    )
    sim = Sim(port, proc)
    sim.reader = threading.Thread(target=sim.read, daemon=True)
    sim.reader.start()
    return sim


@dataclass(frozen=True)
class Farm:
    gateway_url: str
    sims: tuple[Sim, Sim, Sim]
    dead_url: str  # a port on which nothing listens


@pytest.fixture(scope="module")
def farm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Farm]:
    base = free_port_block(6)
    sims = (start_sim(base), start_sim(base + 1), start_sim(base + 2))
    spec = ManagedGateway(
        host="127.0.0.1", port=base + 3, metrics_port=base + 4, policy="round_robin"
    )
    tmp = tmp_path_factory.mktemp("smg")
    (tmp / "admin.key").write_text(ADMIN_KEY + "\n")
    # The way a managed unit runs it: the admin key comes from a file, not the argv.
    launcher = [sys.executable, "-m", "sglang_farm.gateway.launch"]
    argv = smg_argv(spec, smg=[*launcher, "--admin-key-file", str(tmp / "admin.key")])
    assert ADMIN_KEY not in " ".join(argv)
    log = tmp / "smg.log"
    with log.open("w") as out:
        gw = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"{spec.url}/health", 30, "smg", log)
        for s in sims:
            wait_http(f"{s.url}/health", 30, f"simulator on {s.port}", s.tail)
        yield Farm(spec.url, sims, f"http://127.0.0.1:{base + 5}")
    finally:
        kill_group(gw)
        for s in sims:
            stop_sim(s)


@pytest.fixture
async def gw(farm: Farm) -> AsyncIterator[SmgGateway]:
    """The adapter under test; afterwards the gateway is left with no worker at all."""
    async with SmgGateway(farm.gateway_url, api_key=ADMIN_KEY, add_timeout=15) as g:
        yield g
        for m in await g.list():
            await g.remove(m.url)
        end = time.monotonic() + 10
        while await g.list():
            assert time.monotonic() < end, f"workers left in the gateway: {await g.list()}"
            await asyncio.sleep(0.05)


async def raw_add(farm: Farm, url: str, settle_s: int) -> None:
    """Register a worker the way another host's farm (or an operator) would."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        body = {"url": url, "health": {"drain_settle_secs": settle_s}}
        r = await c.post(f"{farm.gateway_url}/workers", json=body)
        assert r.status_code == 202, r.text
        end = time.monotonic() + 10
        while not any(
            w["url"] == url and w["status"] == "ready"
            for w in (await c.get(f"{farm.gateway_url}/workers")).json()["workers"]
        ):
            assert time.monotonic() < end, f"{url} not registered within 10 s"
            await asyncio.sleep(0.05)


@dataclass
class Load:
    """Clients sending one-token chat completions through the gateway, one after another."""

    url: str
    statuses: list[int | str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with httpx.AsyncClient(timeout=10) as c:
            while not self.stop.is_set():
                try:
                    r = await c.post(f"{self.url}/v1/chat/completions", json=body)
                    self.statuses.append(r.status_code)
                except httpx.HTTPError as exc:
                    self.statuses.append(repr(exc))


async def wait_for(pred: object, deadline_s: float, what: str) -> None:
    assert callable(pred)
    end = time.monotonic() + deadline_s
    while not pred():
        assert time.monotonic() < end, f"{what}: not within {deadline_s} s"
        await asyncio.sleep(0.02)


# -- the contract, for the real gateway and the fake ----------------------------------------


async def check_contract(gw: Gateway, worker: str, other: str) -> None:
    """What the farm relies on from any `Gateway`; `other` is registered by someone else."""
    assert await gw.up()
    await gw.add(worker + "/")  # normalized: the same worker as `worker`
    await gw.add(worker)  # idempotent
    routed = {m.url for m in await gw.list() if m.routed}
    assert routed == {worker, other}
    other_id = next(m.id for m in await gw.list() if m.url == other)
    await gw.remove(worker)
    assert worker not in {m.url for m in await gw.list() if m.routed}
    await gw.remove(worker)  # idempotent: unknown URLs are a no-op
    after = {m.url: m for m in await gw.list()}
    assert after[other].routed and after[other].id == other_id


async def test_fake_gateway_honours_the_contract() -> None:
    fake = FakeGateway(others=["http://10.0.0.2:30000"])
    await check_contract(fake, "http://127.0.0.1:30000", "http://10.0.0.2:30000")
    assert fake.calls[0] == ("add", "http://127.0.0.1:30000")
    fake.down = True
    assert not await fake.up()
    with pytest.raises(GatewayError) as err:
        await fake.add("http://127.0.0.1:30000")
    assert err.value.code is GatewayErrorCode.UNREACHABLE


@pytest.mark.slow
@needs_smg
@pytest.mark.timeout(60)
async def test_smg_gateway_honours_the_contract(farm: Farm, gw: SmgGateway) -> None:
    a, c = farm.sims[0], farm.sims[2]
    await raw_add(farm, c.url, settle_s=0)
    await check_contract(gw, a.url, c.url)


# -- smg: membership and routing ------------------------------------------------------------


@pytest.mark.slow
@needs_smg
@pytest.mark.timeout(60)
async def test_add_lists_and_routes_the_worker(farm: Farm, gw: SmgGateway) -> None:
    a = farm.sims[0]
    t0 = time.monotonic()
    await gw.add(a.url)
    [m] = await gw.list()
    assert (m.url, m.status, m.model_id) == (a.url, "ready", MODEL)
    load = Load(farm.gateway_url)
    task = asyncio.create_task(load.client())
    try:
        await wait_for(lambda: len(a.served_after(t0)) >= 5, 10, f"requests served by {a.url}")
    finally:
        load.stop.set()
        await task
    assert set(load.statuses) == {200}


@pytest.mark.slow
@needs_smg
@pytest.mark.timeout(60)
async def test_remove_returns_once_no_request_is_routed_to_it(farm: Farm, gw: SmgGateway) -> None:
    a, b = farm.sims[0], farm.sims[1]
    await gw.add(a.url)
    await gw.add(b.url)
    t0 = time.monotonic()
    load = Load(farm.gateway_url)
    tasks = [asyncio.create_task(load.client()) for _ in range(4)]
    try:
        await wait_for(
            lambda: len(a.served_after(t0)) >= 5 and len(b.served_after(t0)) >= 5,
            10,
            "requests served by both workers",
        )
        await gw.remove(a.url)
        removed_at = time.monotonic()
        await asyncio.sleep(2.0)  # the clients keep sending all along
    finally:
        load.stop.set()
        await asyncio.gather(*tasks)
    # A request dispatched to `a` before remove() returned is logged when it is answered,
    # about 10 ms later (one token); 0.5 s leaves room for a loaded machine. Anything
    # later was routed to `a` after the gateway said it no longer routes there.
    late = [round(h - removed_at, 3) for h in a.served_after(removed_at + 0.5)]
    assert late == [], f"{a.url} got requests this long after remove() returned: {late}"
    assert len(b.served_after(removed_at + 0.5)) >= 10, "the load stopped: nothing proven"
    assert set(load.statuses) == {200}, "a request failed while a worker was removed"
    assert a.url not in {m.url for m in await gw.list()}


@pytest.mark.slow
@needs_smg
@pytest.mark.timeout(60)
async def test_add_waits_until_a_worker_still_draining_is_gone(farm: Farm, gw: SmgGateway) -> None:
    # Registered elsewhere with a 1 s settle time, then deleted: smg answers 409 to a new
    # POST of the same URL until it has left (its settle window), and add() must wait.
    a = farm.sims[0]
    await raw_add(farm, a.url, settle_s=1)
    [m] = await gw.list()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        r = await c.delete(f"{farm.gateway_url}/workers/{m.id}")
        assert r.status_code == 202, r.text
    end = time.monotonic() + 5
    while [x.status for x in await gw.list()] != ["draining"]:
        assert time.monotonic() < end, f"not draining: {await gw.list()}"
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    await gw.add(a.url)
    waited = time.monotonic() - t0
    [m2] = await gw.list()
    assert m2.routed and m2.id != m.id
    assert waited > 0.5, f"add() returned after {waited:.2f} s, before the old entry left"


@pytest.mark.slow
@needs_smg
@pytest.mark.timeout(60)
async def test_add_of_a_worker_that_never_answers_times_out_naming_it(
    farm: Farm, gw: SmgGateway
) -> None:
    async with SmgGateway(farm.gateway_url, api_key=ADMIN_KEY, add_timeout=1.5) as short:
        with pytest.raises(GatewayError) as err:
            await short.add(farm.dead_url)
    assert err.value.code is GatewayErrorCode.TIMEOUT
    assert farm.dead_url in str(err.value) and farm.gateway_url in str(err.value)
    assert await gw.list() == []


@pytest.mark.slow
@needs_smg
@pytest.mark.timeout(60)
async def test_a_wrong_or_missing_key_is_unauthorized_and_not_up(farm: Farm) -> None:
    for key, says in (("wrong-key", "refused the farm's key"), (None, "the farm has none")):
        async with SmgGateway(farm.gateway_url, api_key=key) as g:
            assert not await g.up()
            with pytest.raises(GatewayError) as err:
                await g.add(farm.sims[0].url)
        assert err.value.code is GatewayErrorCode.UNAUTHORIZED
        assert says in str(err.value) and farm.gateway_url in str(err.value)
        assert "wrong-key" not in str(err.value)


async def test_gateway_down_is_not_up_and_add_raises_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port_block(1)}"  # bound and released: nothing listens
    async with SmgGateway(url, api_key="k", request_timeout=2) as g:
        assert not await g.up()
        with pytest.raises(GatewayError) as err:
            await g.add("http://127.0.0.1:30000")
        with pytest.raises(GatewayError):
            await g.list()
    assert err.value.code is GatewayErrorCode.UNREACHABLE
    assert str(err.value).startswith(f"gateway {url}: cannot reach it")


# -- the managed gateway's command line (pure) -----------------------------------------------


def test_managed_argv_binds_metrics_to_the_gateway_host_and_passes_keys() -> None:
    spec = ManagedGateway(
        host="127.0.0.1",
        port=8000,
        metrics_port=8001,
        policy="cache_aware",
        worker_urls=("http://127.0.0.1:30000",),
        api_key="user-key",
        admin_key="admin-key",
        extra_args=("--cb-failure-threshold", "20"),
    )
    assert smg_argv(spec, smg=["/venv/bin/smg"]) == [
        "/venv/bin/smg", "launch", "--host", "127.0.0.1", "--port", "8000",
        "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", "8001",
        "--worker-urls", "http://127.0.0.1:30000", "--api-key", "user-key",
        "--control-plane-api-keys", "sglang-farm:sglang-farm:admin:admin-key",
        "--cb-failure-threshold", "20",
    ]  # fmt: skip
    assert spec.url == "http://127.0.0.1:8000"
    assert spec.control_key == "admin-key"
    assert ManagedGateway("0.0.0.0", 8000, "round_robin", 8001).url == "http://127.0.0.1:8000"


def test_managed_argv_refuses_owned_flags_in_extra_args_and_unknown_policies() -> None:
    spec = ManagedGateway(
        host="::1",
        port=8000,
        metrics_port=8000,
        policy="fastest",
        api_key="has blank",
        extra_args=("--port=9000", "--log-json"),
    )
    assert problems(spec) == [
        "policy: expected one of random, round_robin, passthrough, cache_aware, power_of_two, "
        "least_load, manual, consistent_hashing, prefix_hash, got 'fastest'",
        "metrics_port: must differ from port (8000)",
        "api_key: expected a non-empty key without blanks",
        "extra_args: --port is set by the farm from the gateway config; remove it from extra_args",
    ]
    with pytest.raises(ValueError, match="managed gateway: policy"):
        smg_argv(spec)
    assert spec.url == "http://[::1]:8000"


def test_managed_gateway_off_loopback_needs_a_key() -> None:
    open_to_all = ManagedGateway("0.0.0.0", 8000, "round_robin", 8001)
    assert problems(open_to_all) == [
        "admin_key: required when the gateway listens on '0.0.0.0' (not loopback): without a "
        "key anyone who reaches it can add and remove its backends"
    ]
    assert problems(ManagedGateway("0.0.0.0", 8000, "round_robin", 8001, admin_key="k")) == []
    assert problems(ManagedGateway("localhost", 8000, "round_robin", 8001)) == []


def test_launcher_reads_keys_from_files_and_refuses_them_on_its_command_line(
    tmp_path: Path,
) -> None:
    (tmp_path / "api").write_text("user-key\n")
    (tmp_path / "admin").write_text("  admin-key  \n")
    files = ["--api-key-file", str(tmp_path / "api"), "--admin-key-file", str(tmp_path / "admin")]
    args = smg_args([*files, "launch", "--host", "127.0.0.1", "--port", "8000"])
    assert args == [
        "launch", "--host", "127.0.0.1", "--port", "8000", "--api-key", "user-key",
        "--control-plane-api-keys", "sglang-farm:sglang-farm:admin:admin-key",
    ]  # fmt: skip
    with pytest.raises(SystemExit):  # argparse's usage error; no abbreviation of --api-key-file
        smg_args(["launch", "--api-key", "k"])
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match=f"admin key file {tmp_path / 'empty'} must hold"):
        smg_args(["--admin-key-file", str(tmp_path / "empty"), "launch"])
    with pytest.raises(SystemExit, match="cannot read the API key file"):
        smg_args(["--api-key-file", str(tmp_path / "missing"), "launch"])
