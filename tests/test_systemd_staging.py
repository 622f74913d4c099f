"""Model staging under a real systemd (issue 16): reboot-like, the tmpfs emptied and the
target started again -> the model is staged, then the canary, then the rest.

One throwaway container (tests/sdcontainer.py) for the module; the tests run in order
and share one farm (4 simulator workers, canary 0, parallel 2) whose `[sglang]
model_path` is on the container's own /dev/shm (a real tmpfs) and whose `[model] source`
is a directory with a SHA256SUMS. What is asserted comes from the agent's JSON events in
its journal (model_staged before the first worker_launching), from systemd (the units'
states), from the files themselves (`sha256sum -c` in the copy) and from `farmctl --json`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sdcontainer import SystemdContainer
from sdfarm import AGENT, CONFIG, TARGET, SdFarm, farm_toml, install_farm

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

N = 4
IDS = range(N)
SOURCE = "/srv/models/sd-model"
STAGED = "/dev/shm/sd-model"


def log(msg: str) -> None:
    print(msg, file=sys.stderr)


def staging_toml(headroom: str | int = 0) -> str:
    return farm_toml(
        workers=N,
        canary=0,
        parallel=2,
        sglang={"model_path": STAGED},
        model={"source": SOURCE, "headroom": headroom},
    )


@pytest.fixture(scope="module")
def farm(sd_container: SystemdContainer) -> Iterator[SdFarm]:
    """The farm installed (not started) with a 24 MiB model on a persistent directory."""
    c = sd_container
    c.sh(
        f"mkdir -p {SOURCE} && cd {SOURCE} && head -c 25165824 /dev/urandom > "
        "model.safetensors && printf '{}' > config.json && "
        "sha256sum model.safetensors config.json > SHA256SUMS"
    )
    install_farm(c, staging_toml())
    yield SdFarm(c)
    c.run(["systemctl", "stop", TARGET], check=False, timeout=60)


def _all_active(farm: SdFarm) -> tuple[bool, dict[int, str]]:
    states = farm.states(IDS)
    return all(s == "active" for s in states.values()), states


def _run_events(farm: SdFarm, pid: int) -> list[dict[str, Any]]:
    return [e for e in farm.agent_events() if e["_pid"] == pid]


def _staged_then_canary(farm: SdFarm, pid: int) -> dict[str, Any]:
    """This agent run's model_staged event, checked to precede every worker launch."""
    events = _run_events(farm, pid)
    staged = [e for e in events if e["event"] == "model_staged"]
    launches = [e for e in events if e["event"] == "worker_launching"]
    assert staged and launches, [e["event"] for e in events]
    assert staged[0]["_t"] <= launches[0]["_t"], (staged[0], launches[0])
    assert launches[0]["worker"] == 0  # the canary first
    return staged[0]


def test_systemctl_start_stages_the_model_then_starts_the_canary(farm: SdFarm) -> None:
    t0 = time.monotonic()
    farm.c.run(["systemctl", "start", TARGET], timeout=90)
    farm.wait("every worker active", lambda: _all_active(farm), timeout=90)
    log(f"staged and {N} workers active {time.monotonic() - t0:.1f} s after systemctl start")
    staged = _staged_then_canary(farm, farm.agent_pid())
    assert staged["copied_bytes"] > 24 << 20 and staged["current"] is False
    # The copy is the source, byte for byte, readable by the workers.
    farm.c.sh(f"cd {STAGED} && sha256sum -c --quiet SHA256SUMS")
    st = farm.farmctl("--json", "status")
    assert st["staging"]["state"] == "done" and st["staging"]["target"] == STAGED
    shown = farm.farmctl("status").stdout
    assert f"model {SOURCE} -> {STAGED} · staged" in shown, shown


def test_an_agent_restart_keeps_the_current_copy(farm: SdFarm) -> None:
    before = farm.agent_pid()
    farm.c.run(["systemctl", "restart", AGENT], timeout=90)
    farm.wait("a new agent", lambda: ((p := farm.agent_pid()) not in (0, before), p), timeout=60)
    pid = farm.agent_pid()
    farm.wait(
        "model_staged logged",
        lambda: (bool(e := [x for x in _run_events(farm, pid) if x["event"] == "model_staged"]), e),
        timeout=30,
    )
    (staged,) = [x for x in _run_events(farm, pid) if x["event"] == "model_staged"]
    assert staged["current"] is True and staged["copied_bytes"] == 0
    # The new agent adopts the workers and restarts none: its rollout is done with each
    # adopted, and no worker was launched (or stopped) by it.
    farm.wait(
        "the new agent's rollout done",
        lambda: (bool([x for x in _run_events(farm, pid) if x["event"] == "rollout_done"]), pid),
        timeout=60,
    )
    events = _run_events(farm, pid)
    relaunched = [(x["event"], x.get("worker")) for x in events if x["event"] == "worker_launching"]
    assert relaunched == [], [(x["event"], x.get("worker"), x.get("why")) for x in events]
    ok, states = _all_active(farm)
    assert ok, (states, [{k: v for k, v in x.items() if not k.startswith("_")} for x in events])


def test_reboot_like_empty_tmpfs_and_target_restart_stages_then_rolls_out(farm: SdFarm) -> None:
    farm.c.run(["systemctl", "stop", TARGET], timeout=90)
    farm.c.sh(f"rm -rf {STAGED}")  # what a reboot does to a tmpfs
    farm.c.run(["systemctl", "start", TARGET], timeout=90)
    farm.wait("every worker active", lambda: _all_active(farm), timeout=90)
    staged = _staged_then_canary(farm, farm.agent_pid())
    assert staged["copied_bytes"] > 24 << 20
    farm.c.sh(f"cd {STAGED} && sha256sum -c --quiet SHA256SUMS")


def test_a_model_that_does_not_fit_starts_no_worker_and_why_says_so(farm: SdFarm) -> None:
    farm.c.run(["systemctl", "stop", TARGET], timeout=90)
    farm.c.sh(f"rm -rf {STAGED}")
    farm.c.write_file(CONFIG, staging_toml(headroom="1000TiB"))
    try:
        farm.c.run(["systemctl", "start", TARGET], timeout=90)
        pid = farm.agent_pid()
        farm.wait(
            "model_stage_failed logged",
            lambda: (
                any(e["event"] == "model_stage_failed" for e in _run_events(farm, pid)),
                [e["event"] for e in _run_events(farm, pid)],
            ),
            timeout=30,
        )
        time.sleep(3)  # no worker starts, no crash loop
        assert set(farm.states(IDS).values()) == {"inactive"}
        assert not [e for e in _run_events(farm, pid) if e["event"] == "worker_launching"]
        assert farm.c.run(["test", "-e", STAGED], check=False).returncode == 1
        st = farm.farmctl("--json", "status")
        assert st["staging"]["state"] == "failed" and st["staging"]["error_kind"] == "no_space"
        why = farm.farmctl("why", "1").stdout
        assert "not enough space" in why and "/dev/shm (tmpfs)" in why, why
        assert "[model] headroom" in why, why
    finally:
        farm.c.write_file(CONFIG, staging_toml())
        farm.c.run(["systemctl", "stop", TARGET], timeout=90)
