"""Pure: one worker's membership in several gateways as the supervisor sees it (issue 26).

With `[gateway] urls`, every ready worker is a member of every gateway, and a planned
stop drains it out of all of them first. Each gateway confirms on its own
(`workers.gateway_sync.MembershipSync.confirmed`); the supervisor keeps one word per worker,
`in_gateway`, that gates two things: a rolling wave waits until its workers are back in
(`Supervisor._settled`; `farmctl wait` asks more: every gateway answering and routing
to it, `control.settled.settled_result`), and a drain waits until the worker is out
(`workers.drain`). So the word leans the safe way for what is wanted:

- joining (the worker should be routed): in once *every* gateway that answers
  routes to it; out while any of them does not;
- leaving (it should not be routed): out once *none* of the gateways that answer
  routes to it; in while any of them still does.

A gateway that does not answer (down, or slow past its bounds: a call that timed out
marks it down) is left out of both rules, so it never holds a wave or a stop: it
routes nothing the farm can see, and its own reconcile repairs it when it returns. With
no gateway answering there is no news: the word stays as it was (a drain then goes on
by `gateway_routes_nothing`, as with one gateway).
"""

from __future__ import annotations

from collections.abc import Iterable


def combined(want: bool, confirmed: Iterable[bool | None]) -> bool | None:
    """The supervisor's `in_gateway` for a worker, from what each answering gateway
    confirmed (True routed, False not, None not known yet); None: no news, keep it.

    `want` is the core's rule (`wants_in_gateway`): joining, the first gateway that does
    not route to it keeps it out; leaving, the first that still routes keeps it in.
    """
    seen = list(confirmed)
    if not seen:
        return None
    blocking = not want  # the value any one gateway can impose
    if any(c is blocking for c in seen):
        return blocking
    if all(c is want for c in seen):
        return want
    return None  # some gateway has not said yet
