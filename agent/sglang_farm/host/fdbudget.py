"""Pure: how the agent's file descriptors are shared between the clients it accepts and the rest.

The agent is one process: its workers' pipes (process runtime), health probes, worker
polls, staging, the gateway's child and its own files all draw on one `RLIMIT_NOFILE`.
Two servers accept connections from local users: the control socket and the metrics
exporter. Each may hold at most a fraction of the limit (an eighth each), so however many
idle or slow connections someone opens, three quarters of the descriptors stay for the
farm's own work, and the next connection past a cap is answered (`busy`, 503) or made room
for, never left hanging in the listen queue while accept() fails with EMFILE.

The numbers come from the issue that found the flood (issue 22, item 13): with the
process runtime's inherited soft limit of 1,024, 1,100 idle control connections made
accept() fail and farmctl time out; the agent now raises its soft limit to the hard one
at start (`nofile_target`) and derives both caps from whatever it got.
"""

from __future__ import annotations

from typing import Final

# Each server's share of the descriptor limit: 1/SHARE.
SHARE: Final = 8
# A floor so a tiny limit still serves an operator and a scraper or two.
MIN_CAP: Final = 16
# The control socket: far above any real use (a few operators, scripts); bounds fds.
CONTROL_MAX: Final = 1024
# The exporter's connections still sending their request (one fd and at most
# `exporter.MAX_REQUEST_BYTES` each): Prometheus sends at once, so these are slow or idle
# clients; bounded so their buffers stay small (4,096 x 8 KiB = 32 MiB at worst).
EXPORTER_MAX: Final = 4096
# When the hard limit is "unlimited", the soft one cannot follow it (the kernel's
# fs.nr_open caps it, 1,048,576 by default): this is what the agent asks for instead.
UNLIMITED_TARGET: Final = 1 << 20


def _share(nofile: int, ceiling: int) -> int:
    return max(MIN_CAP, min(ceiling, nofile // SHARE))


def usable(soft: int, unlimited: int) -> int:
    """The soft limit as a count (`unlimited` is `resource.RLIM_INFINITY`)."""
    return UNLIMITED_TARGET if soft == unlimited else soft


def control_client_cap(nofile: int) -> int:
    """Control connections held at once under a soft descriptor limit of `nofile`."""
    return _share(nofile, CONTROL_MAX)


def exporter_pending_cap(nofile: int) -> int:
    """Exporter connections waiting for their request under a soft limit of `nofile`."""
    return _share(nofile, EXPORTER_MAX)


def nofile_target(soft: int, hard: int, unlimited: int) -> int | None:
    """The soft limit to ask for (the hard one), or None when it is already there.

    `unlimited` is `resource.RLIM_INFINITY`; an unlimited hard limit gets
    `UNLIMITED_TARGET` (never lowered below the current soft limit).
    """
    want = UNLIMITED_TARGET if hard == unlimited else hard
    if soft == unlimited or soft >= want:
        return None
    return want
