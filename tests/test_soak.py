"""The chaos soak (bench/soak.py) in its CI form: 2 minutes of seeded random faults.

A farm of simulator workers under the real systemd of a throwaway container
(tests/sdcontainer.py), a managed gateway and a load through it; worker SIGKILL,
SIGSTOP and OOM, agent SIGKILL, valid and invalid reloads, garbage on the control
socket and bursts of idle exporter connections, then quiet. The verdict (every worker
ready, counters equal to the faults injected, every simulator process in its unit,
the state file parses, no request failed outside the unplanned kills) must pass.

`SF_SOAK_MINUTES` changes the length (10 for the documented run), `SF_SOAK_SEED`
replays a seed (printed at the start and with the verdict; `random` draws one; by
default CI replays seed 7).
"""

from __future__ import annotations

import os
import random
import sys

import pytest
from bench import soak

import sdcontainer

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

CI_SEED = 7


def test_chaos_soak_ends_with_every_worker_ready_and_counters_equal_to_faults() -> None:
    sdcontainer.require_or_skip()
    minutes = float(os.environ.get("SF_SOAK_MINUTES", "2"))
    # CI replays one schedule (a failure is then reproducible); SF_SOAK_SEED=random
    # draws a new one, as the documented long runs do.
    seed_env = os.environ.get("SF_SOAK_SEED", str(CI_SEED))
    seed = random.SystemRandom().randrange(2**31) if seed_env == "random" else int(seed_env)
    print(f"chaos soak seed {seed} (replay: SF_SOAK_SEED={seed})", file=sys.stderr)
    res = soak.run(minutes, seed)
    text = soak.table(res)
    print(text, file=sys.stderr)
    kinds = {f.kind for f in res.faults}
    assert kinds == set(soak.FAULTS), f"not every fault kind was injected: {kinds}\n{text}"
    assert res.verdict is not None and res.verdict.ok, text
