"""sglang-farm: one SGLang server per GPU, supervised, observable, controllable.

The version has one source, pyproject.toml: `__version__` reads the installed
distribution's metadata (pip writes it from pyproject; `build-deb` checks that
debian/changelog agrees). It is looked up only when asked for, so commands that do not
print it do not pay for importlib.metadata.
"""

from __future__ import annotations

from functools import cache


@cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang-farm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
