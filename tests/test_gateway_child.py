"""The managed gateway as a child of the agent: its back-off and its log file (issue 22).

Item 10: a gateway that cannot start (smg not installed) is tried, and logged, once per
back-off step, doubling up to 10 min. Items 11/12: `gateway.log` is written by root in
the state folder, which may be one another user can write (the demo's /tmp): a symlink
planted there is never followed, the file is 0640 and the agent's own.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from asuser import as_nobody, nobody_owned
from sglang_farm.errors import RuntimeFailure
from sglang_farm.gateway.managed import ManagedGateway, launch_argv
from sglang_farm.runtime.gateway_child import (
    LOG_MAX_BYTES,
    RESTART_MAX_S,
    STABLE_S,
    ChildGateway,
    open_log,
    restart_delay,
)

pytestmark = pytest.mark.anyio

AGENT_DIR = Path(__file__).resolve().parent.parent / "agent"


def test_restart_delay_doubles_from_1_s_to_10_min_and_a_stable_run_starts_over() -> None:
    delays: list[float] = []
    d: float | None = None
    for _ in range(12):
        d = restart_delay(d, ran_s=0.1)
        delays.append(d)
    assert delays == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 600, 600]
    assert RESTART_MAX_S == 600
    assert restart_delay(600, ran_s=STABLE_S) == 1


def _no_smg_argv() -> list[str]:
    """The managed gateway's real command line, under an interpreter without smg: the
    system Python, finding this package through PYTHONPATH (set by the caller)."""
    spec = ManagedGateway(host="127.0.0.1", port=1, policy="round_robin", metrics_port=2)
    return launch_argv(spec, os.path.realpath("/usr/bin/python3"))


def _system_python_has_smg() -> bool:
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no system Python to play a host without smg")
    r = subprocess.run(["/usr/bin/python3", "-c", "import smg"], capture_output=True)
    return r.returncode == 0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_gateway_without_smg_is_logged_once_per_back_off_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if _system_python_has_smg():
        pytest.skip("the system Python has smg: it cannot play a host without it")
    monkeypatch.setenv("PYTHONPATH", str(AGENT_DIR))
    waits: list[float] = []
    parked = asyncio.Event()

    async def sleep(delay: float) -> None:  # the back-off, counted instead of waited
        waits.append(delay)
        if len(waits) == 6:
            parked.set()
            await asyncio.Event().wait()

    gw = ChildGateway(_no_smg_argv(), tmp_path / "gateway.log", sleep=sleep)
    with capture_logs() as logs:
        await gw.start()
        await asyncio.wait_for(parked.wait(), 60)
        await gw.close()
    assert waits == [1, 2, 4, 8, 16, 32]
    loud = [e for e in logs if e["log_level"] in ("warning", "error")]
    assert [e["event"] for e in loud] == ["gateway_exited"] * 6
    assert [e["retry_in_s"] for e in loud] == waits
    assert "smg is not installed" in (tmp_path / "gateway.log").read_text()


async def test_a_gateway_that_cannot_be_run_says_why_once_per_step(tmp_path: Path) -> None:
    waits: list[float] = []
    parked = asyncio.Event()

    async def sleep(delay: float) -> None:
        waits.append(delay)
        if len(waits) == 3:
            parked.set()
            await asyncio.Event().wait()

    gw = ChildGateway([str(tmp_path / "no-such-smg"), "launch"], tmp_path / "g.log", sleep=sleep)
    with capture_logs() as logs:
        await gw.start()
        await asyncio.wait_for(parked.wait(), 60)
        await gw.close()
    loud = [e for e in logs if e["log_level"] in ("warning", "error")]
    assert [e["event"] for e in loud] == ["gateway_not_started"] * 3
    assert "no-such-smg" in loud[0]["error"]


# -- gateway.log -------------------------------------------------------------------------------


def test_the_gateway_log_is_made_0640_and_an_old_0644_one_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "state" / "gateway.log"
    with open_log(path) as f:
        f.write(b"one\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    os.chmod(path, 0o644)
    with open_log(path) as f:
        f.write(b"two\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.read_bytes() == b"one\ntwo\n"


def test_an_oversized_gateway_log_keeps_its_last_part(tmp_path: Path) -> None:
    path = tmp_path / "gateway.log"
    with open(path, "wb") as f:
        f.truncate(LOG_MAX_BYTES)
        f.seek(LOG_MAX_BYTES)
        f.write(b"the last line\n")
    with open_log(path) as f:
        f.write(b"after\n")
    size = path.stat().st_size
    assert size < LOG_MAX_BYTES // 2 + 4096
    assert path.read_bytes().endswith(b"the last line\nafter\n")


def test_a_symlink_planted_by_nobody_as_the_gateway_log_is_never_followed(
    shared_dir: Path,
) -> None:
    """The demo's state folder under /tmp: nobody made it (0777) and plants gateway.log
    as a link to a root-only file. Root's agent refuses it, naming it and the fix; the
    file is untouched."""
    secret = shared_dir / "root-only"
    secret.write_text("root's\n")
    os.chmod(secret, 0o600)
    state = nobody_owned(shared_dir, "state", 0o777)
    as_nobody(["ln", "-s", str(secret), str(state / "gateway.log")])

    with pytest.raises(RuntimeFailure, match=r"gateway log .*gateway\.log is a symbolic link"):
        open_log(state / "gateway.log")
    assert secret.read_text() == "root's\n"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_a_gateway_log_another_user_made_is_refused(shared_dir: Path) -> None:
    state = nobody_owned(shared_dir, "state", 0o777)
    as_nobody(["sh", "-c", f"umask 0; : > {state}/gateway.log"])
    with pytest.raises(RuntimeFailure, match="not a plain file of the agent's own"):
        open_log(state / "gateway.log")


async def test_the_agent_starts_no_gateway_into_a_planted_log(shared_dir: Path) -> None:
    secret = shared_dir / "root-only"
    secret.write_text("root's\n")
    os.chmod(secret, 0o600)
    state = nobody_owned(shared_dir, "state", 0o777)
    as_nobody(["ln", "-s", str(secret), str(state / "gateway.log")])
    parked = asyncio.Event()

    async def sleep(delay: float) -> None:
        parked.set()
        await asyncio.Event().wait()

    gw = ChildGateway(
        [sys.executable, "-c", "print('smg here')"], state / "gateway.log", sleep=sleep
    )
    with capture_logs() as logs:
        await gw.start()
        await asyncio.wait_for(parked.wait(), 30)
        await gw.close()
    assert secret.read_text() == "root's\n"
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["gateway_not_started"]
    assert not any(e["event"] == "gateway_started" for e in logs)


async def test_smg_writes_its_log_without_colour_codes(tmp_path: Path) -> None:
    """Issue 25 item 8: smg's text log carries ANSI colours even into a file."""
    from farmproc import free_port_block

    base = free_port_block(2)
    spec = ManagedGateway(
        host="127.0.0.1",
        port=base,
        policy="round_robin",
        metrics_port=base + 1,
        extra_args=("--log-level", "info"),
    )
    path = tmp_path / "gateway.log"
    gw = ChildGateway(launch_argv(spec, sys.executable), path)
    await gw.start()
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while b"INFO" not in (path.read_bytes() if path.exists() else b""):
            assert loop.time() < end, "smg wrote no log line (extra_args asked for info)"
            await asyncio.sleep(0.1)
    finally:
        await gw.close()
    assert b"\x1b" not in path.read_bytes()


async def test_the_farms_own_polls_of_the_gateway_stay_out_of_its_log(tmp_path: Path) -> None:
    """Issue 25 item 8: 3,322 of ~5,000 lines of gateway.log were the farm's GET /workers."""
    import httpx

    from farmproc import free_port_block

    base = free_port_block(2)
    spec = ManagedGateway(host="127.0.0.1", port=base, policy="round_robin", metrics_port=base + 1)
    path = tmp_path / "gateway.log"
    gw = ChildGateway(launch_argv(spec, sys.executable), path)
    await gw.start()
    try:
        async with httpx.AsyncClient() as client:
            loop = asyncio.get_running_loop()
            end = loop.time() + 30
            polled = 0
            while polled < 20:
                assert loop.time() < end, "smg never answered GET /workers"
                try:
                    r = await client.get(f"{spec.url}/workers", timeout=2)
                    polled += r.status_code == 200
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
    finally:
        await gw.close()
    logged = path.read_text(errors="replace")
    assert '"smg::request"' not in logged and '"smg::response"' not in logged


# --- issue 30, item 5: smg's log bounded while it runs -----------------------------------


async def _smg_with_log(path: Path) -> tuple[ChildGateway, str]:
    """The real smg as the agent runs it (process runtime), answering; its URL."""
    import httpx

    from farmproc import free_port_block

    base = free_port_block(2)
    spec = ManagedGateway(host="127.0.0.1", port=base, policy="round_robin", metrics_port=base + 1)
    gw = ChildGateway(launch_argv(spec, sys.executable), path)
    await gw.start()
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    async with httpx.AsyncClient() as client:
        while True:
            assert loop.time() < end, "smg never answered GET /workers"
            try:
                if (await client.get(f"{spec.url}/workers", timeout=2)).status_code == 200:
                    return gw, spec.url
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)


async def _unknown_models(url: str, n: int, size: int = 900_000) -> list[int]:
    """`n` chat requests naming a `size`-byte model smg does not know (it logs the name
    in a WARN line); their status codes."""
    import httpx

    body = {"model": "m" * size, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient() as client:
        return [
            (await client.post(f"{url}/v1/chat/completions", json=body, timeout=30)).status_code
            for _ in range(n)
        ]


def _logged(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("gateway.log*"))


async def test_a_client_naming_huge_models_cannot_grow_the_gateway_log(tmp_path: Path) -> None:
    """900 kB unknown model names gave 90 MB of gateway.log in 10 s: smg echoes the name
    in a WARN line. Each line now keeps its first 16 KiB and says how much was cut."""
    path = tmp_path / "gateway.log"
    gw, url = await _smg_with_log(path)
    try:
        codes = await _unknown_models(url, 12)
        assert codes == [404] * 12
        await asyncio.sleep(0.5)  # the agent writes what it read
    finally:
        await gw.close()
    assert _logged(tmp_path) < 1 << 20  # 10.8 MB before
    assert b"more bytes of this line cut]" in path.read_bytes()


async def test_smg_keeps_routing_when_its_log_cannot_be_written(tmp_path: Path) -> None:
    """On a full state_dir smg could not start (`PanicException: failed printing to
    stdout`) and the front door stayed down. Its output goes through the agent, which
    drops what it cannot write and says so once."""
    import httpx

    from fulldisk import fill, small_tmpfs

    with small_tmpfs(tmp_path / "state") as d, capture_logs() as logs:
        path = d / "gateway.log"
        path.touch(mode=0o640)
        fill(d)
        gw, url = await _smg_with_log(path)
        try:
            assert await _unknown_models(url, 5, size=50_000) == [404] * 5
            pid = gw.pid
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"{url}/workers", timeout=5)).status_code == 200
            await asyncio.sleep(0.5)
            assert gw.pid == pid and pid is not None  # still the same smg
        finally:
            await gw.close()
    said = [e for e in logs if e["event"] == "gateway_log_not_written"]
    assert len(said) == 1 and "No space left" in said[0]["error"]


def test_the_log_is_rotated_so_both_files_stay_under_the_bound(tmp_path: Path) -> None:
    from sglang_farm.runtime.gateway_child import GatewayLog

    path = tmp_path / "gateway.log"
    sink = GatewayLog(path, max_bytes=4096, line_max=100)
    sink.open()
    try:
        for i in range(500):
            sink.write([f"line {i:04d} ".encode() + b"x" * 50 + b"\n"])
    finally:
        sink.close()
    assert _logged(tmp_path) <= 4096
    assert path.read_bytes().endswith(b"line 0499 " + b"x" * 50 + b"\n")
    assert (tmp_path / "gateway.log.1").exists()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def test_cap_lines_keeps_whole_lines_and_the_start_of_a_long_one() -> None:
    from sglang_farm.runtime.gateway_child import cap_lines

    lines, pending, cut = cap_lines(b"ab", b"c\nde\nfghijk", 4)
    assert lines == [b"abc\n", b"de\n"] and pending == b"fghi" and cut == 2
