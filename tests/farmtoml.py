"""Pure (test helper): a simulator farm's farm.toml, built as tables, for every harness.

The Agent on a virtual clock (agent_harness.py), `sglang-farm run` as child processes
(farmproc.py) and the farm in the systemd container (sdfarm.py) all run the simulator
farm; `sim_farm` is its one shape, and each harness states its own differences as
tables merged over it. No test patches config text: a key it changes is a key of a
table it passes, so a key renamed in the config makes `load_spec` refuse the config
(unknown key) where a `.replace()` on the text would silently change nothing.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

Table = Mapping[str, Any]
Doc = dict[str, dict[str, Any]]


def sim_farm(gpus: int | Sequence[int], python: str, /, **tables: Table) -> Doc:
    """The simulator farm, a worker on each of `gpus` (a count: GPUs 0..n-1; or a list),
    run by the interpreter `python`, with each of `tables` merged key by key over the
    table of that name (a value of None drops the key)."""
    doc: Doc = {
        "farm": {"name": "test-farm", "python": python, "module": "sglang_farm.sim"},
        "workers": {
            "gpus": list(range(gpus)) if isinstance(gpus, int) else list(gpus),
            "host": "127.0.0.1",
            "base_port": 30000,
        },
        "startup": {"canary": 0},
        "health": {},
        "restart": {},
        "metrics": {},
        "control": {},
        "sglang": {"model_path": "sim/model"},
        # No canary analysis unless a test asks for it (issue 23): the tests written
        # before it expect the next wave as soon as the canary is ready.
        "rollout": {"analysis_window": "0s"},
    }
    return merged(doc, tables)


def merged(doc: Mapping[str, Table], tables: Mapping[str, Table]) -> Doc:
    """`doc` with each of `tables` merged key by key over its table of that name (a new
    table is added; a value of None drops the key)."""
    out: Doc = {name: dict(table) for name, table in doc.items()}
    for name, table in tables.items():
        into = out.setdefault(name, {})
        for key, value in table.items():
            if value is None:
                into.pop(key, None)
            else:
                into[key] = value
    return out


def rewritten(text: str, **tables: Table) -> str:
    """The farm.toml `text` (a running farm's, to reload) with `tables` merged over it."""
    return toml_text(merged(tomllib.loads(text), tables))


def toml_text(doc: Mapping[str, Table]) -> str:
    """`doc` as TOML: one `[table]` each (empty ones left out), nested values inline."""
    parts = []
    for name, table in doc.items():
        if table:
            lines = [f"{_key(k)} = {_value(v)}" for k, v in table.items()]
            parts.append(f"[{name}]\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)


def _key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_key(str(k))} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, Sequence):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r} ({type(value).__name__})")
