"""I/O (the passwd and group databases): the config's accounts that this host lacks.

Under systemd each worker's unit names `[farm] user` and `[farm] group` (`User=`,
`Group=`), and the agent's own drop-in names `[control] group` and `[farm] group`
(`SupplementaryGroups=`, `units.agent_groups`). systemd refuses to start a unit whose
account does not exist (status 217/USER, 216/GROUP), and the agent's drop-in takes
effect at its next start: a missing group written into it stops the agent from starting
again, after a reboot say, with nothing in its log. So the agent refuses such a config
under systemd when it loads it (start, reload) and `check-config` warns of it.
"""

from __future__ import annotations

import pwd
from collections.abc import Callable

from sglang_farm.control.auth import group_gid
from sglang_farm.spec import FarmSpec


def account_fix(user: str, group: str) -> str:
    """The fix for a missing workers' account (a home for SGLang's caches, no shell)."""
    return (
        f"create the account the workers run as (e.g. `groupadd --system {group}; useradd "
        f"--system --gid {group} --home-dir /var/lib/sglang --shell /usr/sbin/nologin "
        f"{user}`), or set [farm] user and group to an existing one"
    )


def missing_accounts(
    spec: FarmSpec, *, user_exists: Callable[[str], bool], group_exists: Callable[[str], bool]
) -> list[str]:
    """Pure: a problem line for each account of `spec` the lookups do not find."""
    problems = []
    user = spec.farm.user
    if user != "root" and not user_exists(user):
        problems.append(
            f"[farm] user {user!r} does not exist on this host: systemd would refuse to "
            f"start the workers (User=, status 217/USER); {account_fix(user, spec.farm.group)}"
        )
    pairs = [(spec.control.group, "[control] group"), (spec.farm.group, "[farm] group")]
    for group in dict.fromkeys(g for g, _ in pairs):
        if group == "root" or group_exists(group):
            continue
        keys = " and ".join(k for g, k in pairs if g == group)
        workers = " and the workers (Group=)" if group == spec.farm.group else ""
        problems.append(
            f"{keys} {group!r} does not exist on this host: systemd would refuse to start "
            f"the agent from its next start on (its unit's SupplementaryGroups=){workers}, "
            f"status 216/GROUP; create it (`groupadd --system {group}`) or set {keys} to "
            "an existing group"
        )
    return problems


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _group_exists(name: str) -> bool:
    return group_gid(name) is not None


def host_account_problems(spec: FarmSpec) -> list[str]:
    """`missing_accounts` against this host's passwd and group databases."""
    return missing_accounts(spec, user_exists=_user_exists, group_exists=_group_exists)
