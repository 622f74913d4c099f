"""Routes SGLang removed in 0.5.20 (`/get_load` for `/v1/loads`; `/get_weight_version` and
`/weight_version` for `/model_info`'s `weight_version`): nothing in the farm relies on them
(issue 34 §2). No module of the agent names one, and the simulator answers each 404 as
0.5.23 does, as 0.5.12 too: so every farm test of either version runs without them."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from simproc import StartSim

AGENT = Path(__file__).resolve().parent.parent / "agent" / "sglang_farm"
REMOVED = ("/get_load", "/get_weight_version", "/weight_version")
# A route as a path: the removed name not followed by more of a name (smg's own `/get_loads`
# is the gateway's route, not a worker's).
_ROUTE = re.compile(r"/(get_load|get_weight_version|weight_version)(?![A-Za-z0-9_])")


def test_no_module_of_the_agent_names_a_removed_route() -> None:
    found = [
        f"{path.relative_to(AGENT)}:{n}: {line.strip()}"
        for path in sorted(AGENT.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _ROUTE.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("version", ["0.5.23", "0.5.12"])
def test_the_simulator_answers_the_removed_routes_404(
    sims: StartSim,
    version: str,
) -> None:
    sim = sims(env={"SGLANG_SIM_LOAD_SECONDS": "0", "SGLANG_SIM_VERSION": version})
    sim.wait_ready()
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        assert [client.get(route).status_code for route in REMOVED] == [404, 404, 404]
        assert client.get("/model_info").json()["weight_version"] == "default"
        assert client.get("/v1/loads").status_code == 200
