"""Pure: every string value in the config is one line of printable text.

Runs before the sections: values are written into unit files (a newline would start a
new directive), command lines and environments.
"""

from __future__ import annotations

from sglang_farm.config.lines import _Path
from sglang_farm.config.problems import _Problems

_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\0": "a NUL"}


def _control_char(text: str) -> str | None:
    """The first C0 control character or DEL in `text`, named for people; None if none."""
    for ch in text:
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return _CONTROL_NAMES.get(ch, f"the control character {ch!r}")
    return None


def _refuse_control_chars(problems: _Problems, value: object, path: _Path = ()) -> None:
    """Refuse every string value holding a control character, wherever it is.

    Values end up in unit files (User=, Environment=, ExecStart=), whose parser reads a
    newline as the start of the next directive (`ExecStartPre=+...` runs as root), in
    argv and environments (no NUL can pass), and in log and status lines. The key is
    then marked refused, so the section's own checks do not report it again.
    """
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_control_chars(problems, item, (*path, key))
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, dict | list):
                _refuse_control_chars(problems, item, (*path, i))
            elif isinstance(item, str) and (found := _control_char(item)) is not None:
                _refuse_control(problems, path, found, f" (item {i + 1})")
                return
        return
    if isinstance(value, str) and (found := _control_char(value)) is not None:
        _refuse_control(problems, path, found, "")


def _refuse_control(problems: _Problems, path: _Path, found: str, where: str) -> None:
    nul = "; no process can receive a NUL" if found == "a NUL" else ""
    problems.add(
        path,
        f"contains {found}{where}, a control character: every value must be one line "
        f"of printable text (it goes into unit files, command lines and environments{nul}); "
        "remove it (a JSON value fits on one line)",
    )
    problems.refused.add(path)
