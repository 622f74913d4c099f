"""Pure: which config the agent starts on, from the canary record and the config file
(issue 32 §1: a decision of the core, not of the canary driver's I/O).

The file's config, unless the record says its change was rejected (then the accepted
config, the change HELD) or was never accepted (then the accepted config first, and the
file's change rolls as a reload would: canary first, judged). With analysis off, the
file's, unless its change was rejected: a rejected change never runs, whatever the
window. A rejected change with no usable accepted config starts nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from sglang_farm.canary import record
from sglang_farm.canary.record import Accepted, RejectedChanges, Rejection
from sglang_farm.errors import ConfigError
from sglang_farm.spec import FarmSpec


@dataclass(frozen=True, slots=True)
class OnFile:
    """Start on the file's config and accept it. `unjudged` says why its change is run
    without a canary's judgement although it was never accepted (None: nothing to say)."""

    unjudged: str | None = None


@dataclass(frozen=True, slots=True)
class OnAccepted:
    """Start on the accepted config. `held`: the file's change was rejected (it waits
    for an edit); None: it was never accepted, and rolls canary first once started."""

    accepted: FarmSpec
    held: Rejection | None


@dataclass(frozen=True, slots=True)
class Refused:
    """Start nothing: the file's change was rejected and the accepted config cannot run."""

    problem: str


StartChoice = OnFile | OnAccepted | Refused


def utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def start_choice(
    spec: FarmSpec,
    desired: str,
    acc: Accepted | None,
    rejected: RejectedChanges,
    load: Callable[[str], FarmSpec],
    record_path: str,
) -> StartChoice:
    """`desired`: the change hash of the file's config; `acc` and `rejected`: the canary
    record's; `load` parses a recorded config's text (raising ConfigError);
    `record_path`: the record's file, named in the refusal's fix."""
    rejection = rejected.rejection(desired)
    if rejection is None and (
        spec.rollout.analysis_window <= 0 or acc is None or acc.change == desired
    ):
        return OnFile()
    accepted, why = _usable_accepted(spec, acc, load)
    if accepted is not None:
        return OnAccepted(accepted, rejection)
    if rejection is None:
        return OnFile(unjudged=why)
    return Refused(
        f"{spec.source}: change {record.short(desired)} was rejected by its canary "
        f"at {utc(rejection.at)}: {rejection.evidence}; the accepted config cannot be run "
        f"instead ({why}) so nothing starts: put the config file back on the accepted "
        f"config, or remove the change's entry from {record_path} to run it anyway"
    )


def _usable_accepted(
    spec: FarmSpec, acc: Accepted | None, load: Callable[[str], FarmSpec]
) -> tuple[FarmSpec | None, str]:
    """The accepted config as it can run beside the file's, or None and why not."""
    if acc is None:
        return None, "no accepted config is recorded"
    if acc.text is None:
        return None, "the accepted config's text was not recorded"
    try:
        accepted = load(acc.text)
    except ConfigError as exc:
        return None, "the accepted config no longer loads: " + "; ".join(exc.problems)
    if accepted.worker_ids != spec.worker_ids:
        return None, "the accepted config has other workers than the file's"
    # [gateway] is not a change a canary judges (the workers run the same): it is set up
    # at the agent's start, and only a start applies it (a reload refuses it), so the
    # file's is taken; else its worker change could never roll.
    return replace(accepted, gateway=spec.gateway), ""
