"""Pure: the doctor's flag rules: a worker's command line as the installed SGLang judges it.

Its own parser (envprobe's `flags` mode) decides, over the argv the worker will run
(`worker_commands`); for a flag it rejects whose other spelling `sglang.flags.RENAMES`
knows, the message names the spelling of the installed version ("SGLang 0.5.12 calls it
--mamba-scheduler-strategy"). OOM-ladder steps are checked for such spellings too.
"""

from __future__ import annotations

from sglang_farm.doctor.checks import Check, CheckId, FlagsOutcome, ProbeOutcome, Status
from sglang_farm.sglang.flags import (
    SGLANG_MODULE,
    Version,
    flag_key,
    flag_name,
    log_advice,
    parse_version,
    stale_spelling,
    unknown_flag_hint,
    version_text,
)
from sglang_farm.spec import FarmSpec, WorkerSpec

_FIX_PARSER = (
    "make `sglang.srt.server_args` importable in the SGLang environment "
    "(it needs torch) so the doctor can use SGLang's own parser"
)


def installed_sglang(probe: ProbeOutcome | None) -> Version | None:
    """The SGLang version the environment probe found (its package metadata), if any."""
    if probe is None or probe.result is None:
        return None
    sg = probe.result.get("sglang") or {}
    return parse_version(sg.get("version")) if sg.get("installed") else None


def _spelling_check(key: str, installed: Version | None, why: str) -> Check | None:
    """A FAIL naming the installed SGLang's spelling of `key`, when the table knows one."""
    if installed is not None:
        hint = unknown_flag_hint(key, installed)
        if hint is None:
            return None
        says, fix = hint
        return Check(
            CheckId.FLAGS,
            Status.FAIL,
            f"{flag_name(key)} is not a flag of SGLang {version_text(installed)} ({why}): {says}",
            fix,
        )
    advice = log_advice(key)
    if advice is None:
        return None
    return Check(
        CheckId.FLAGS,
        Status.FAIL,
        f"{flag_name(key)} is not a flag of the installed SGLang ({why})",
        advice,
    )


def flag_checks(
    spec: FarmSpec, w: WorkerSpec, outcome: FlagsOutcome | None, installed: Version | None
) -> list[Check]:
    """The worker's flags as the installed SGLang judges them.

    Its parser decides; without one, the rename table judges by the installed version
    (when the probe found one) and otherwise only warns about an older spelling.
    """
    if spec.farm.module != SGLANG_MODULE:
        return [
            Check(
                CheckId.FLAGS,
                Status.SKIP,
                f"module {spec.farm.module} is not {SGLANG_MODULE}: flags not validated",
            )
        ]
    ladder = _ladder_flag_checks(spec, installed)
    out: list[Check] = []
    if outcome is None or not outcome.parser or outcome.result is None:
        why = (outcome.error if outcome else None) or "no result"
        out.append(
            Check(
                CheckId.FLAGS,
                Status.WARN,
                f"cannot validate flags: sglang not importable ({why})",
                _FIX_PARSER,
            )
        )
        for key in w.flags:
            if installed is not None:
                found = _spelling_check(key, installed, "by the farm's table of renamed flags")
                if found is not None:
                    out.append(found)
            elif (stale := stale_spelling(key)) is not None:
                out.append(
                    Check(
                        CheckId.FLAGS,
                        Status.WARN,
                        f"{key}: {stale}",
                        "check which spelling the installed SGLang uses",
                    )
                )
        return ladder + out
    res = outcome.result
    hard = False
    for tok in res.get("tokens") or ():
        flag, match = str(tok.get("flag")), tok.get("match")
        snake = flag_key(flag)
        if match in ("unknown", "ambiguous"):
            hard = True
            why = (
                "argparse: unrecognized arguments, exit 2"
                if match == "unknown"
                else f"argparse: ambiguous, could match {', '.join(tok.get('candidates') or ())}, "
                "exit 2"
            )
            found = _spelling_check(snake, installed, why)
            if found is not None:
                out.append(found)
            elif match == "unknown":
                out.append(
                    Check(
                        CheckId.FLAGS,
                        Status.FAIL,
                        f"{flag} is not a flag of the installed SGLang (argparse: "
                        "unrecognized arguments, exit 2)",
                        f"remove or correct {snake} in [sglang]; `{spec.farm.python} -m "
                        f"{SGLANG_MODULE} --help` lists the flags",
                    )
                )
            else:
                cands = ", ".join(tok.get("candidates") or ())
                out.append(
                    Check(
                        CheckId.FLAGS,
                        Status.FAIL,
                        f"{flag} is ambiguous: it could match {cands} (argparse exit 2)",
                        f"write the full name of one of them instead of {snake}",
                    )
                )
        elif match == "prefix":
            full = str(tok.get("expands_to"))
            out.append(
                Check(
                    CheckId.FLAGS,
                    Status.WARN,
                    f"{flag} is not a full flag name: SGLang's argparse accepts it as "
                    f"an abbreviation of {full}",
                    f"write {flag_key(full)} in [sglang] (an "
                    "abbreviation can bind to another flag after an upgrade)",
                )
            )
    error = res.get("error")
    if res.get("exit_status") and not hard:
        out.append(
            Check(
                CheckId.FLAGS,
                Status.FAIL,
                f"SGLang's parser rejects the command line: {error}",
                "correct the value in [sglang]",
            )
        )
    if not out:
        n = len(res.get("tokens") or ())
        out.append(Check(CheckId.FLAGS, Status.PASS, f"{n} flags accepted by SGLang's parser"))
    return ladder + out


def _ladder_flag_checks(spec: FarmSpec, installed: Version | None) -> list[Check]:
    """OOM-ladder steps that would set a flag the installed SGLang spells otherwise.

    A warning, not a failure: the step only runs after an out-of-memory failure, and
    then the worker fails with argparse's exit 2 instead of stepping down.
    """
    if installed is None:
        return []
    out: list[Check] = []
    for step in spec.oom.steps:
        for a in step.adjust:
            hint = unknown_flag_hint(a.flag, installed, "in that [[oom.steps]] table")
            if hint is not None:
                says, fix = hint
                out.append(
                    Check(
                        CheckId.FLAGS,
                        Status.WARN,
                        f"OOM step {step.name!r} changes {flag_name(a.flag)}, which "
                        f"SGLang {version_text(installed)} does not have: {says}",
                        fix,
                    )
                )
    return out
