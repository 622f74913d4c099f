"""I/O: the farm's membership in all of its gateways (issue 26: `[gateway] urls`).

One `workers.gateway_sync.MembershipSync` per gateway, each with its own tasks, retries,
back-off and periodic reconcile, so a gateway that is down or slow delays nothing on
the others: a restarted (empty) gateway is refilled by its own reconcile while the
others keep routing. What the gateways confirmed is turned into the supervisor's one
word per worker by the pure rule `gateway.membership.combined` (joining: in every
gateway that answers; leaving: out of all of them), fed as `GatewayMembership` when it
changes. A gateway that stops answering is left out of that rule once a call to it got
no answer or its list failed (each call is bounded: `workers.gateway_sync`), so a drain never
waits on it for longer than that bound; its `gateway_down` line says so. A gateway that
answers but refuses one worker stays in the rule (`sync.not_answering`): it may still
route to every other worker, so their drains wait for it.

With one gateway this is that gateway's sync and the same events, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from sglang_farm.gateway.membership import combined
from sglang_farm.gateway.port import Gateway
from sglang_farm.gateway.status import GatewayStatus
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.gateway_sync import MembershipSync
from sglang_farm.workers.supervisor import Event, GatewayMembership, WorkerState, wants_in_gateway

SETTLE_PASSES = 8  # a bound, never reached: each feed makes the word what it compares to


class GatewayFleet:
    """Every gateway's membership sync, and the combined word the supervisor gets."""

    def __init__(
        self,
        gateways: Sequence[Gateway],
        *,
        spec: Callable[[], FarmSpec],
        states: Callable[[], Mapping[int, WorkerState]],
        feed: Callable[[int, Event], None],
        on_status: Callable[[], None] = lambda: None,
        kept_out: Callable[[], Collection[int]] = frozenset,
    ) -> None:
        """`kept_out`: workers no gateway routes to whatever their state (a canary
        waiting for its eval gate: canary.rollout.kept_out_of_gateway)."""
        if not gateways:
            raise ValueError("GatewayFleet needs at least one gateway")
        self._states, self._feed, self._on_status = states, feed, on_status
        self._kept_out = kept_out
        self._settling = False
        self._again = False
        self.syncs = tuple(
            MembershipSync(
                g,
                spec=spec,
                states=states,
                kept_out=kept_out,
                on_member=lambda _w, _m: self._settle(),
                on_status=self._status_changed,
            )
            for g in gateways
        )

    @property
    def up(self) -> bool:
        """True while any gateway answers (a drain otherwise waits on no gateway)."""
        return any(s.up for s in self.syncs)

    @property
    def gateway_url(self) -> str:
        """The gateways' URLs, for the log's summary lines."""
        return ", ".join(s.gateway_url for s in self.syncs)

    def status(self) -> GatewayStatus:
        each = tuple(s.status() for s in self.syncs)
        if len(each) == 1:
            return each[0]
        errors = [f"{g.url}: {g.last_error}" for g in each if g.last_error]
        return GatewayStatus(
            url=each[0].url,  # a URL still (readers of one gateway); `gateways` has all
            up=any(g.up for g in each),
            members=sum(1 for s in self._states().values() if s.in_gateway),
            errors=sum(g.errors for g in each),
            last_error="; ".join(errors) or None,
            foreign=tuple(sorted({u for g in each for u in g.foreign})),
            gateways=each,
            # A worker once (the first gateway's reason), as `foreign` names a URL once.
            overloaded=tuple(
                sorted({w: r for g in reversed(each) for w, r in g.overloaded}.items())
            ),
        )

    def unconfirmed_out(self, serving: Iterable[int]) -> dict[str, tuple[int, ...]]:
        """Issue 30 item 11: each gateway that does not answer, with the workers it never
        confirmed out: of `serving`, those it did not confirm out, and any other it last
        held. A drain goes on without it (it counts as routing nothing), but a
        frozen gateway that wakes up routes to them again: `drain-host` names it."""
        wanted = set(serving)
        out: dict[str, tuple[int, ...]] = {}
        for s in self.syncs:
            if s.up:
                continue  # it answers: the drain waited for its word
            # Out means no longer held (a confirmed remove, a list without it): a worker
            # held but not routed is routed again once the gateway's health check passes.
            ids = wanted | {w for w, held in s.held.items() if held}
            left = tuple(sorted(w for w in ids if s.held.get(w) is not False))
            if left:
                out[s.gateway_url] = left
        return out

    def start(self) -> None:
        for s in self.syncs:
            s.start()

    async def close(self) -> None:
        for s in self.syncs:
            await s.close()

    def update(self) -> None:
        """The farm changed: each gateway's gaps fixed, the combined word brought up to date."""
        for s in self.syncs:
            s.update()
        self._settle()

    def _status_changed(self) -> None:
        self._settle()  # a gateway going down or up changes whom the rule asks
        self._on_status()

    def _settle(self) -> None:
        """Feed `GatewayMembership` for each worker whose combined word changed."""
        if self._settling:
            self._again = True  # fed from inside a feed: look again when it returns
            return
        self._settling = True
        try:
            self._again, passes = True, 0
            while self._again and passes < SETTLE_PASSES:
                self._again, passes = False, passes + 1
                kept_out = self._kept_out()
                for wid in list(self._states()):
                    s = self._states().get(wid)  # fresh: a feed may have changed it
                    if s is None:
                        continue
                    word = combined(
                        wants_in_gateway(s) and wid not in kept_out,
                        (sync.confirmed.get(wid) for sync in self.syncs if sync.up),
                    )
                    if word is not None and word != s.in_gateway:
                        self._feed(wid, GatewayMembership(word))
        finally:
            self._settling = False
