"""Under a real systemd: the batch service's shipped unit, `sglang-farm-batch.service`
(issue 33), starts with the farm's target, runs unprivileged as its own user, serves
OpenAI's `/v1/batches` behind its key, runs a batch through the farm's workers to the end
(`farmctl batch submit --wait`, inside), and stops with the target.

The container gets the package's users from its sysusers file (`systemd-sysusers`), so
`sglang-farm-batch` is the member of `sglang-farm` the unit expects; the key file is
0640 root:sglang-farm, as docs/batch.md says to make it. The unit is the shipped one with
only its ExecStart= pointed at this venv (a drop-in, as tests/sdfarm.py does for the agent).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from farmtoml import Table
from sdcontainer import VENV_PYTHON, SystemdContainer
from sdfarm import (
    AGENT,
    CONFIG,
    FARMCTL,
    TARGET,
    SdFarm,
    farm_toml,
    http_get,
    install_farm,
    open_test_venv_to_dynamic_users,
)
from sglang_farm.runtime.units import static_unit

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


ROOT = Path(__file__).resolve().parent.parent
BATCH = "sglang-farm-batch.service"
LISTEN = "127.0.0.1:8300"
KEY_FILE = "/etc/sglang-farm/batch-api.key"
KEY = "sd-batch-key-0123456789abcdef0123456789abcdef"
STATE = "/var/lib/sglang-farm-batch"
N_REQUESTS = 40


# The batch service, and the control socket handed to the farm's group: the batch
# service reads the ready workers there.
TABLES: dict[str, Table] = {
    "batch": {
        "enabled": True,
        "listen": LISTEN,
        "api_key_file": KEY_FILE,
        "max_attempts": 5,
        "retry_backoff_s": "0.2s",
    },
    "control": {"socket": "/run/sglang-farm/control.sock", "group": "sglang-farm"},
}


def install_batch(c: SystemdContainer) -> None:
    """The package's users, the key, the shipped unit (ExecStart= at this venv), enabled."""
    c.run(
        ["systemd-sysusers", "-"],
        input=(ROOT / "packaging/debian/sglang-farm.sysusers").read_text(),
    )
    c.write_file(KEY_FILE, KEY + "\n", mode=0o640)
    c.run(["chgrp", "sglang-farm", KEY_FILE])
    c.write_file(f"/etc/systemd/system/{BATCH}", static_unit(BATCH))
    venv_batch = str(Path(VENV_PYTHON).parent / "sglang-farm-batch")
    c.write_file(
        f"/etc/systemd/system/{BATCH}.d/50-dev.conf",
        f"[Service]\nExecStart=\nExecStart={venv_batch} --config {CONFIG}\n",
    )
    # The agent hands the control socket to the farm's group (no CAP_CHOWN: a member).
    c.write_file(
        f"/etc/systemd/system/{AGENT}.d/60-group.conf",
        "[Service]\nSupplementaryGroups=sglang-farm\n",
    )
    open_test_venv_to_dynamic_users(c)
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "enable", BATCH])


@pytest.fixture(scope="module")
def farm(sd_container: SystemdContainer) -> Iterator[SdFarm]:
    toml = farm_toml(
        workers=2, canary=0, parallel=2, batch=TABLES["batch"], control=TABLES["control"]
    )
    install_farm(sd_container, toml)
    install_batch(sd_container)
    yield SdFarm(sd_container)


def _main_pid(farm: SdFarm) -> int:
    return int(farm.show([BATCH], "MainPID")[BATCH].get("MainPID") or 0)


def test_the_batch_unit_starts_with_the_target_unprivileged_and_serves_batches(
    farm: SdFarm, sd: SystemdContainer
) -> None:
    c = farm.c
    c.run(["systemctl", "start", TARGET], timeout=120)
    farm.wait(f"{BATCH} active", lambda: ((s := farm.is_active(BATCH)) == "active", s), 60)
    farm.wait(
        "both workers ready",
        lambda: (
            (st := farm.status()).keys() == {0, 1}
            and all(w["state"] == "ready" for w in st.values()),
            st,
        ),
        timeout=120,
    )
    # Unprivileged: its own user, in the farm's group, no capabilities.
    pid = _main_pid(farm)
    assert pid > 0
    status = c.run(["cat", f"/proc/{pid}/status"]).stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uid = fields["Uid"].split()[0]
    assert uid != "0"
    assert c.run(["id", "-u", "sglang-farm-batch"]).stdout.strip() == uid
    sglang_farm_gid = c.run(["getent", "group", "sglang-farm"]).stdout.split(":")[2]
    assert sglang_farm_gid in fields["Groups"].split()
    assert int(fields["CapEff"].strip(), 16) == 0 and int(fields["CapBnd"].strip(), 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    # Its state directory is its own and closed to others.
    st = c.run(["stat", "-L", "-c", "%U %a", STATE]).stdout.split()
    assert st == ["sglang-farm-batch", "700"], st
    # The API: the key is required; with it, /v1/batches lists (nothing yet).
    code, _ = http_get(c, f"http://{LISTEN}/v1/batches")
    assert code == 401
    code, body = http_get(c, f"http://{LISTEN}/v1/batches", key=KEY)
    assert code == 200 and body["object"] == "list" and body["data"] == [], body
    code, text = http_get(c, f"http://{LISTEN}/metrics")
    assert code == 200 and "sglang_farm_batch_in_flight" in str(text)


def test_a_batch_runs_through_the_workers_to_one_result_per_request(
    farm: SdFarm, sd: SystemdContainer
) -> None:
    c = farm.c
    lines = [
        json.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "sim/Qwen3.6-27B",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"count to {i}"}],
                },
            }
        )
        for i in range(N_REQUESTS)
    ]
    c.write_file("/var/tmp/in.jsonl", "\n".join(lines) + "\n")
    r = c.run(
        [
            FARMCTL,
            "--config",
            CONFIG,
            "batch",
            "submit",
            "/var/tmp/in.jsonl",
            "--wait",
            "--timeout",
            "240",
        ],
        check=False,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr + c.journal(BATCH, lines=60)
    bid = r.stdout.split()[0]
    assert f"batch {bid} completed: {N_REQUESTS} of {N_REQUESTS} requests succeeded" in r.stdout
    r = c.run(
        [FARMCTL, "--config", CONFIG, "batch", "results", bid, "-o", "/var/tmp/out.jsonl"],
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = [json.loads(x) for x in c.run(["cat", "/var/tmp/out.jsonl"]).stdout.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(N_REQUESTS))
    assert all(o["response"]["status_code"] == 200 for o in out)
    # The files it keeps are its own: nobody else may read them.
    files = c.sh(f"find {STATE}/ -type f -printf '%u %m %p\\n'").stdout.splitlines()
    assert files and all(f.split()[0] == "sglang-farm-batch" for f in files), files
    assert all(int(f.split()[1], 8) & 0o077 == 0 for f in files), files


def test_stopping_the_target_stops_the_batch_service(farm: SdFarm, sd: SystemdContainer) -> None:
    c = farm.c
    c.run(["systemctl", "stop", TARGET], timeout=120)
    farm.wait(
        f"{BATCH} stopped",
        lambda: ((s := farm.is_active(BATCH)) in ("inactive", "failed"), s),
        60,
    )
    assert farm.is_active(BATCH) == "inactive"  # a clean stop, not a failure
