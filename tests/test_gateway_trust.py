"""The managed gateway's worker API against other local users (issue 22, items 3 and 8).

The farm runs as root; `nobody` must not be able to add a backend to the farm's
gateway (and so receive its users' prompts) or take the farm's workers out of it. A
managed gateway always has an admin key (generated root-only in the state directory
when the config names none), anything in it that the farm did not add is removed, and
users' chat requests stay keyless unless `api_key_file` says otherwise. The attacker's
requests run as nobody for real (tests/asuser.py); the gateway is the real smg.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asuser import as_nobody, nobody_python, require
from farmproc import farm_config, free_port_block, new_marker, tmpdir
from farmtoml import rewritten
from frontdoor_farm import running_farm
from managed_gateway import managed_section, members, routed
from sglang_farm.errors import ConfigError
from sglang_farm.gateway.adminkey import ensure_admin_key
from sglang_farm.gateway.managed import GENERATED_ADMIN_KEY_NAME

needs_smg = pytest.mark.skipif(
    importlib.util.find_spec("smg") is None,
    reason="smg (SGLang's gateway) is not installed: pip install smg==1.13.0",
)
MODEL = "sim/Qwen3.6-27B"

# What nobody runs: one HTTP request with the standard library, printing the status.
REQUEST = """
import json, sys, urllib.request, urllib.error
method, url, body = sys.argv[1], sys.argv[2], sys.argv[3]
req = urllib.request.Request(url, method=method, data=body.encode() or None,
                             headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        print(r.status, r.read().decode()[:300])
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode()[:300])
"""


def nobody_request(method: str, url: str, body: object = None) -> tuple[int, str]:
    """One request sent by nobody: (status, start of the answer)."""
    out = nobody_python(REQUEST, method, url, "" if body is None else json.dumps(body))
    code, _, text = out.stdout.strip().partition(" ")
    return int(code), text


# --- the generated key file -----------------------------------------------------------


def test_the_generated_admin_key_is_root_only_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "state" / GENERATED_ADMIN_KEY_NAME
    old = os.umask(0)  # whatever the agent's umask, the file is 0600
    try:
        key = ensure_admin_key(path)
    finally:
        os.umask(old)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    assert len(key) >= 40 and path.read_text().strip() == key
    assert ensure_admin_key(path) == key  # the next start reuses it


def test_a_key_file_planted_by_another_user_is_refused(shared_dir: Path) -> None:
    """A state folder others can write (like /tmp): nobody plants its own key there
    before the farm's first start. The farm must not adopt a key nobody knows."""
    path = shared_dir / GENERATED_ADMIN_KEY_NAME
    nobody_python(
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n"
        "os.write(fd, b'known-to-nobody')\n",
        str(path),
    )
    with pytest.raises(ConfigError) as err:
        ensure_admin_key(path)
    assert "owned by uid 65534" in str(err.value) and str(path) in str(err.value)


def test_a_planted_link_is_never_followed(shared_dir: Path, tmp_path: Path) -> None:
    """nobody points the key's name at a root-only file (to have it overwritten or read
    as the key) and at a path it will read later: neither is written or trusted."""
    secret = tmp_path / "root-only"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    for target in (secret, shared_dir / "will-read-it"):
        path = shared_dir / GENERATED_ADMIN_KEY_NAME
        as_nobody(["ln", "-sfn", str(target), str(path)])
        with pytest.raises(ConfigError, match="without following links"):
            ensure_admin_key(path)
        as_nobody(["rm", "-f", str(path)])
    assert secret.read_text() == "root's secret\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not (shared_dir / "will-read-it").exists()


def test_a_key_file_others_may_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / GENERATED_ADMIN_KEY_NAME
    path.write_text("k" * 43)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="its mode is 0644"):
        ensure_admin_key(path)


# --- against the real smg ----------------------------------------------------------------


def until(cond: Callable[[], bool], within: float, what: str) -> None:
    end = time.monotonic() + within
    last: object = None
    while time.monotonic() < end:
        try:
            if cond():
                return
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"not within {within} s: {what} (last error: {last!r})")


def event(name: str, worker: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("event") == name and e.get("worker") == worker


@contextlib.contextmanager
def rogue_backend() -> Iterator[str]:
    """An SGLang look-alike that is not the farm's (the simulator on a port of its own)."""
    port = free_port_block(2)
    env = {**os.environ, "SGLANG_SIM_LOAD_SECONDS": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_farm.sim", "--model-path", MODEL, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 30, "rogue up")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def cmdlines_holding(needle: bytes) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
    return found


@pytest.mark.slow
@needs_smg
def test_nobody_cannot_change_the_managed_gateways_members_and_users_stay_keyless() -> None:
    """Issue 22 item 3, as nobody against a managed gateway set up without any key file:
    POST /workers and DELETE /workers/{id} are refused; a member added behind the farm's
    back (with the key) is removed by the next reconcile; chat needs no key."""
    require()
    tmp = tmpdir()
    port = free_port_block(2)
    gw = f"http://127.0.0.1:{port}"
    marker = new_marker()
    config = farm_config(tmp, workers=2, parallel=2, marker=marker, extra=managed_section(port))
    with running_farm(config, marker) as farm, rogue_backend() as rogue:
        for w in (0, 1):
            farm.wait_for(event("gateway_member", w), 90)
        ours = {str(e["url"]) for e in farm.named("gateway_member")}

        # nobody adds its own backend: refused (before: 202, and it took users' prompts).
        code, text = nobody_request("POST", f"{gw}/workers", {"url": rogue})
        assert code in (401, 403), (code, text)

        key_file = tmp / "state" / GENERATED_ADMIN_KEY_NAME
        st = os.lstat(key_file)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == 0
        key = key_file.read_text().strip()
        assert not cmdlines_holding(key.encode()), "the admin key is on a command line"
        assert routed(gw, key) == ours

        # nobody takes a farm worker out: refused, and it stays routed.
        victim = next(w for w in members(gw, key) if w["url"] in ours)
        code, text = nobody_request("DELETE", f"{gw}/workers/{victim['id']}")
        assert code in (401, 403), (code, text)
        assert routed(gw, key) == ours

        # Users' requests need no key (no api_key_file), nobody's included.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        code, text = nobody_request("POST", f"{gw}/v1/chat/completions", chat)
        assert code == 200, (code, text)

        # Someone with the key adds a backend behind the farm's back: the next reconcile
        # (every 10 s) removes it, saying so with its URL.
        r = httpx.post(
            f"{gw}/workers",
            json={"url": rogue},
            headers={"Authorization": f"Bearer {key}"},
            timeout=5,
        )
        assert r.status_code == 202, r.text
        farm.wait_for(
            lambda e: e.get("event") == "gateway_foreign_removed" and e.get("url") == rogue, 40
        )
        until(
            lambda: rogue not in {str(w["url"]) for w in members(gw, key)},
            15,
            "the foreign member gone from the gateway",
        )
        assert routed(gw, key) == ours
        status = json.loads(farm.farmctl("--json", "status").stdout)
        assert status["gateway"]["foreign"] == []


@pytest.mark.slow
@needs_smg
def test_a_reload_adding_api_key_puts_every_worker_back_into_smg() -> None:
    """Issue 22 item 8: after a reload that gives the workers an api_key (farm-wide, and
    another for worker 1), each comes back into the real gateway, which presents each
    worker its own key: users' requests reach both. Before, smg was still given the key
    read at agent start (none) and looped on the workers' 401s: workers stayed out."""
    tmp = tmpdir()
    port = free_port_block(2)
    gw = f"http://127.0.0.1:{port}"
    marker = new_marker()
    config = farm_config(tmp, workers=2, parallel=2, marker=marker, extra=managed_section(port))
    with running_farm(config, marker) as farm:
        for w in (0, 1):
            farm.wait_for(event("gateway_member", w), 90)
        ours = {str(e["url"]) for e in farm.named("gateway_member")}
        key = (tmp / "state" / GENERATED_ADMIN_KEY_NAME).read_text().strip()
        assert routed(gw, key) == ours
        text = rewritten(
            config.read_text(),
            sglang={"api_key": "k-farm-0123"},
            workers={"overrides": {"1": {"sglang": {"api_key": "k-one-4567"}}}},
        )
        config.write_text(text)
        mark = len(farm.snapshot())
        r = farm.farmctl("reload", "--no-wait", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        for w in (0, 1):
            farm.wait_for(event("worker_ready", w), 90, after=mark)
        until(lambda: routed(gw, key) == ours, 60, "both workers back in the gateway")
        # The workers now refuse keyless requests; the gateway's reach them.
        for url in ours:
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        for _ in range(4):  # round robin: both workers answer
            answer = httpx.post(
                f"{gw}/v1/chat/completions",
                timeout=30,
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                },
            )
            assert answer.status_code == 200, answer.text


@contextlib.contextmanager
def keyed_sim_and_gateway(tmp: Path) -> Iterator[tuple[str, str]]:
    """A simulator started with SGLang's --api-key, and an smg (admin key only) in front:
    (worker URL, gateway URL)."""
    from sglang_farm.gateway.managed import ManagedGateway, smg_argv

    wport, gport = free_port_block(1), free_port_block(2)
    (tmp / "admin.key").write_text("admin-key-for-the-test")
    (tmp / "admin.key").chmod(0o600)
    spec = ManagedGateway(
        host="127.0.0.1", port=gport, metrics_port=gport + 1, policy="round_robin"
    )
    argv = smg_argv(
        spec,
        smg=[
            sys.executable,
            "-m",
            "sglang_farm.gateway.launch",
            "--admin-key-file",
            str(tmp / "admin.key"),
        ],
    )
    env = {**os.environ, "SGLANG_SIM_LOAD_SECONDS": "0"}
    log = (tmp / "smg.log").open("w")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_farm.sim",
                "--model-path",
                MODEL,
                "--port",
                str(wport),
                "--api-key",
                WORKER_KEY,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        ),
        subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
    ]
    log.close()  # the child has its own copy
    worker, gateway = f"http://127.0.0.1:{wport}", spec.url
    try:
        until(lambda: httpx.get(f"{gateway}/health", timeout=2).status_code == 200, 30, "smg")
        until(lambda: httpx.get(f"{worker}/health", timeout=2).status_code == 200, 30, "sim")
        yield worker, gateway
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


WORKER_KEY = "k-worker-0123"


@pytest.mark.slow
@needs_smg
@pytest.mark.timeout(120)
@pytest.mark.parametrize("removed_between", [False, True])
async def test_a_registration_stuck_on_an_old_key_gives_way_to_the_new_one(
    tmp_path: Path, removed_between: bool
) -> None:
    """Issue 22 item 8, the gateway's side: a registration made with the worker's old key
    (none) is never listed (smg retries it against the worker's 401s for minutes, and
    answers 409 WORKER_CREATE_IN_PROGRESS to any new POST of the URL). The next add
    with the current key (straight after, or after the drain's remove) must cancel it
    and bring the worker in; before, it waited on the stuck one and timed out."""
    from sglang_farm.errors import GatewayError
    from sglang_farm.gateway.smg import SmgGateway

    with keyed_sim_and_gateway(tmp_path) as (worker, gateway):
        async with SmgGateway(gateway, api_key="admin-key-for-the-test", add_timeout=3) as gw:
            with pytest.raises(GatewayError, match="did not list worker"):
                await gw.add(worker)  # no key: smg's registration loops on 401
            if removed_between:
                await gw.remove(worker)
            await gw.add(worker, api_key=WORKER_KEY)
            assert [(m.url, m.status) for m in await gw.list()] == [(worker, "ready")]
            async with httpx.AsyncClient() as client:
                r = await client.post(
                    f"{gateway}/v1/chat/completions",
                    timeout=30,
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2,
                    },
                )
            assert r.status_code == 200, r.text
