"""Pure: TOML text -> a validated, frozen `FarmSpec`, or every problem at once.

`load_spec(text, source=...)` does no I/O (`tomllib.loads`); `load_spec_file(path)` is
the thin shell that reads one file. Validation runs in two passes: shape and types
per section, then cross-field rules over the resolved workers (one worker per GPU,
unique ports, the canary is a worker, the OOM ladder adjusts configured numbers).
Unknown keys are errors, so a typo never turns into a silent default. Before both, every
string value anywhere is refused if it holds a control character: values are written
into unit files (a newline would start a new directive), command lines and environments.

Every problem is one line, `file:line: key.path: what is wrong (the bad value) and
what is accepted`. tomllib gives no positions, so `_LineIndex` finds them by scanning
the text for table headers and key lines (best effort; no line when it cannot tell).

Raises `errors.ConfigError(source, problems)`. A flag that some SGLang version accepts
is never a problem: a spelling of an older SGLang (`sglang.flags.RENAMES`) is a
warning naming both versions, returned by `check_spec` / `check_spec_file` beside the
spec (this package has no SGLang at hand; the doctor judges flags by the installed
one). Workers listening off loopback without an API key are a warning too. The
reference is `docs/config.md`.

The modules, in the order a load uses them:

- `load`: the entry points (`load_spec`, `check_spec`, and their `_file` shells);
- `lines`: where a key is in the text (`_LineIndex`);
- `problems`: the collected problems and warnings, rendered as lines;
- `printable`: control characters refused anywhere, before the sections;
- `reader`: a table's known keys, one key through a converter, env and flag tables;
- `values`: the converters (durations, sizes, ports, paths, names, addresses);
- `flags`: which keys may be SGLang flags, and their values;
- `sections`, `oom`, `workers`: the first pass, section by section (workers resolved);
- `checks`: the second pass, cross-field rules over the resolved workers.
"""

from sglang_farm.config.load import (
    LoadResult,
    check_spec,
    check_spec_file,
    load_spec,
    load_spec_file,
)
from sglang_farm.config.values import (
    AGENT_PYTHON,
    MAX_DURATION_S,
    parse_duration,
    parse_endpoint,
)
from sglang_farm.config.workers import WorkersDefaults

__all__ = [
    "AGENT_PYTHON",
    "MAX_DURATION_S",
    "LoadResult",
    "WorkersDefaults",
    "check_spec",
    "check_spec_file",
    "load_spec",
    "load_spec_file",
    "parse_duration",
    "parse_endpoint",
]
