"""Issue 30, item 11: `drain-host` never says "drained" while a frozen gateway still lists
the host's workers.

A gateway SIGSTOPped keeps its sockets and its members and answers nothing: the farm's
calls to it time out, it counts as down, and a drain goes on without it (it must not
hold the drain for ever). Before the fix `farmctl drain-host` then answered exit 0 "host
drained ... out of the gateway" while the frozen smg still listed both workers, and
routed to them again once SIGCONTed. Now it names that gateway and exits 11, which a
playbook stops on. Real smg (external mode), real farm of simulators, process runtime.
"""

from __future__ import annotations

import importlib.util
import signal

import pytest

from farmproc import farm_config, free_port_block, new_marker, tmpdir
from frontdoor_farm import running_farm, until, worker_urls
from smgproc import Smg, key_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("smg") is None,
        reason="smg (SGLang's gateway) is not installed: pip install smg==1.13.0",
    ),
]


def test_drain_host_with_a_frozen_gateway_names_it_and_exits_11() -> None:
    tmp = tmpdir()
    key = key_file(tmp)
    with Smg(tmp, key, free_port_block(2)) as gw:
        marker = new_marker()
        section = (
            f'[gateway]\nmode = "external"\nurl = "{gw.url}"\nadmin_key_file = "{key}"\n'
            'drain_timeout = "30s"\n'
        )
        config = farm_config(tmp, workers=2, parallel=2, marker=marker, extra=section)
        urls = set(worker_urls(config))
        with running_farm(config, marker) as farm:
            until(lambda: gw.routed() == urls, 90, "both workers routed")
            gw.freeze()
            try:
                r = farm.farmctl("drain-host", "--timeout", "30", timeout=120)
                assert r.returncode == 11, (r.returncode, r.stdout, r.stderr)
                assert f"could not confirm it out of gateway {gw.url} (workers 0, 1)" in r.stderr
                assert "host drained" not in r.stdout
            finally:
                gw.freeze(signal.SIGCONT)
            # Thawed, the farm's own retries take them out, and the host stays held out.
            until(lambda: gw.routed() == set(), 60, "the thawed gateway emptied by the farm")
            r = farm.farmctl("drain-host", "--timeout", "30", timeout=120)
            assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
            assert "host drained" in r.stdout
