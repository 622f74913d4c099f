"""Under a real systemd: a managed gateway with no key file in the config still has an
admin key (issue 22, item 3).

The agent generates `/var/lib/sglang-farm/gateway-admin.key` (root, 0600) at its first
start; `sglang-farm-gateway.service` loads that same file with `LoadCredential=`, so
smg's worker API refuses a caller without it, the farm (which has it) routes its
workers, no unit file or command line shows it, and users' requests stay keyless.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sdcontainer import SystemdContainer
from sdfarm import (
    AGENT,
    BASE_PORT,
    CONFIG,
    GATEWAY,
    TARGET,
    SdFarm,
    farm_toml,
    gateway_toml,
    http_get,
    install_farm,
    open_test_venv_to_dynamic_users,
)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


IDS = range(2)
LISTEN = "127.0.0.1:8000"
KEY_FILE = "/var/lib/sglang-farm/gateway-admin.key"


@pytest.fixture(scope="module")
def farm(sd_container: SystemdContainer) -> Iterator[SdFarm]:
    install_farm(
        sd_container,
        farm_toml(workers=len(IDS), canary=0, parallel=2) + gateway_toml(listen=LISTEN),
    )
    yield SdFarm(sd_container)


def test_managed_gateway_unit_without_key_files_uses_the_generated_admin_key(
    farm: SdFarm, sd: SystemdContainer
) -> None:
    c = farm.c
    assert "admin_key_file" not in c.run(["cat", CONFIG]).stdout
    open_test_venv_to_dynamic_users(c)
    c.run(["systemctl", "start", AGENT], timeout=90)
    farm.wait(f"{GATEWAY} active", lambda: ((s := farm.is_active(GATEWAY)) == "active", s))
    mode = c.run(["stat", "-c", "%a %U %F", KEY_FILE]).stdout.split(maxsplit=2)
    assert mode == ["600", "root", "regular file\n"], mode
    key = c.run(["cat", KEY_FILE]).stdout.strip()
    assert len(key) >= 40
    urls = {f"http://127.0.0.1:{BASE_PORT + n}" for n in IDS}

    def routed() -> tuple[bool, object]:
        status, body = http_get(c, f"http://{LISTEN}/workers", key=key)
        got = {w["url"] for w in body["workers"]} if status == 200 else set()
        return status == 200 and got == urls, (status, body)

    farm.wait("both workers in the gateway", routed, timeout=60, interval=0.5)
    # Without the key the worker API answers 401; users' routes need none.
    status, _ = http_get(c, f"http://{LISTEN}/workers")
    assert status == 401, status
    status, _ = http_get(c, f"http://{LISTEN}/v1/models")
    assert status == 200, status
    # The key is in no unit file and no command line.
    unit_text = c.run(["systemctl", "cat", GATEWAY]).stdout
    assert f"LoadCredential=admin-key:{KEY_FILE}" in unit_text and key not in unit_text
    cmdlines = c.sh("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '", check=False).stdout
    assert key not in cmdlines
    # The next start reuses it.
    c.run(["systemctl", "restart", AGENT], timeout=90)
    farm.wait("both workers still in the gateway", routed, timeout=60, interval=0.5)
    assert c.run(["cat", KEY_FILE]).stdout.strip() == key
    c.run(["systemctl", "stop", TARGET], timeout=60)
