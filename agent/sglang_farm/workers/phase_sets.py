"""Pure: the sets of worker phases the farm's rules are written in, each named once.

A rule that asks "is this worker serving?" in two modules must get one answer: the sets
live here, beside what each means, and the supervisor, the watchers and the metrics import
them rather than spell the phases out again.
"""

from __future__ import annotations

from sglang_farm.workers.phase import Phase, StopIntent

# Its process is up and meant to stay up: an exit of its own is a failure, a stop
# terminates it (a draining worker is already being stopped, so is not in it).
RUNNING = frozenset({Phase.STARTING, Phase.READY, Phase.UNHEALTHY})

# Came up ready and no stop has begun: in the gateway (when there is one), probed for
# liveness, and drained by a planned stop.
SERVING = frozenset({Phase.READY, Phase.UNHEALTHY})

# Its server answers HTTP, so its polled figures mean something: SERVING, and a draining
# worker, out of the gateway but finishing its requests (its figures falling to 0 are the
# drain itself).
SERVING_OR_DRAINING = frozenset({Phase.READY, Phase.UNHEALTHY, Phase.DRAINING})

# Its stop is under way: out of the gateway and finishing its requests, or its process
# tree is being stopped.
LEAVING = frozenset({Phase.DRAINING, Phase.STOPPING})

# Runs nothing and starts nothing by itself: what a wait for a stop waits for, and the
# phases a restarted agent keeps for a worker that is not running (Supervisor.adopt).
HELD = frozenset({Phase.FAILED, Phase.STOPPED, Phase.QUARANTINED})

# Its process loaded (or is loading) a copy of the model: a reload keeps the previous copy
# while any such worker runs (`workers.loading`).
LOADS_MODEL = frozenset(
    {Phase.STARTING, Phase.READY, Phase.UNHEALTHY, Phase.DRAINING, Phase.BACKOFF}
)


def set_aside(phase: Phase, stop_intent: StopIntent | None) -> bool:
    """Its GPU is set aside: QUARANTINED, or stopping to become so; only a release of the
    GPU brings it back."""
    return phase is Phase.QUARANTINED or stop_intent is StopIntent.QUARANTINE
