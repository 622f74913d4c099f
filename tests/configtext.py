"""A config's text loaded as the agent loads it, and its problems: the config tests and the
modules built on a minimal farm (MINIMAL) share them.
"""

from __future__ import annotations

from textwrap import dedent

import pytest

from sglang_farm.config import (
    load_spec,
)
from sglang_farm.errors import ConfigError
from sglang_farm.spec import (
    FarmSpec,
)

MINIMAL = """\
[workers]
gpus = [0, 1]

[sglang]
model_path = "/models/m"
"""


def load(text: str, *, gpu_count: int | None = None) -> FarmSpec:
    return load_spec(dedent(text), source="farm.toml", gpu_count=gpu_count)


def problems(text: str, *, gpu_count: int | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(text, gpu_count=gpu_count)
    assert info.value.source == "farm.toml"
    return list(info.value.problems)


def only_problem(text: str, *, gpu_count: int | None = None) -> str:
    found = problems(text, gpu_count=gpu_count)
    assert len(found) == 1, found
    return found[0]
