"""`[model]` in farm.toml: strict validation, like every other section (issue 16)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.spec import ModelSpec

SHM = 'model_path = "/dev/shm/Qwen3.6-27B"'


def toml(model: str, *, sglang: str = SHM, extra: str = "") -> str:
    return textwrap.dedent(
        f"""
        [farm]
        python = "{sys.executable}"
        [workers]
        gpus = [0, 1]
        [metrics]
        gpu_source = "none"
        [sglang]
        {sglang}
        {model}
        {extra}
        """
    )


def problems(text: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_spec(text, source="farm.toml")
    return "\n".join(err.value.problems)


def test_without_model_the_farm_does_not_stage() -> None:
    assert load_spec(toml(""), source="farm.toml").model is None


def test_a_local_source_and_a_hub_source_parse() -> None:
    local = load_spec(
        toml(
            '[model]\nsource = "/srv/models/Qwen3.6-27B/"\nheadroom = "2GiB"\n'
            "warm_page_cache = true"
        ),
        source="farm.toml",
    ).model
    assert local == ModelSpec("/srv/models/Qwen3.6-27B", headroom=2 << 30, warm_page_cache=True)
    assert local.is_local
    hub = load_spec(
        toml(
            '[model]\nsource = "Qwen/Qwen3.6-27B"\nrevision = "v1.1"\n'
            'token_file = "/etc/sglang-farm/hf-token"\ncache_dir = "/var/cache/hf"\n'
            "headroom = 1000"
        ),
        source="farm.toml",
    ).model
    assert hub == ModelSpec(
        "Qwen/Qwen3.6-27B", "v1.1", False, 1000, "/etc/sglang-farm/hf-token", "/var/cache/hf"
    )
    assert not hub.is_local


def test_model_problems_say_where_and_what_is_accepted() -> None:
    text = problems(toml('[model]\nsource = "qwen"\nrevison = "x"\nheadroom = "lots"'))
    assert "farm.toml:11: model.source: expected an absolute directory" in text
    assert "model.revison: unknown key (did you mean 'revision'?)" in text
    assert "model.headroom: expected a size" in text
    assert "missing: [model] needs source" in problems(toml("[model]\nheadroom = 0"))
    local_only = problems(toml('[model]\nsource = "/srv/m"\nrevision = "main"'))
    assert "model.revision: only for a Hugging Face repo source" in local_only


def test_model_needs_one_absolute_model_path_of_its_own() -> None:
    per_worker = problems(
        toml(
            '[model]\nsource = "/srv/m"',
            sglang="",
            extra='[workers.overrides.1]\nsglang = { model_path = "/dev/shm/b" }\n'
            '[workers.overrides.0]\nsglang = { model_path = "/dev/shm/a" }',
        )
    )
    assert "sglang.model_path: [model] stages one copy for every worker" in per_worker
    shm = problems(toml('[model]\nsource = "/srv/m"', sglang='model_path = "/dev/shm"'))
    assert "expected an absolute directory of its own" in shm
    overlap = problems(toml('[model]\nsource = "/dev/shm"', sglang='model_path = "/dev/shm/m"'))
    assert "model.source: the source '/dev/shm' and the workers' model_path" in overlap


@pytest.mark.parametrize(
    "bad", ["org/name..x", "a--b/model", "org/model.", "org/-model", "org/model-", ".org/model"]
)
def test_a_repo_id_the_hub_would_refuse_is_a_config_error(bad: str) -> None:
    # huggingface_hub's validate_repo_id refuses '--' and '..' anywhere and a leading or
    # trailing '.' or '-' in a part: caught here, not as a stage stuck mid-way.
    assert "model.source: expected an absolute directory" in problems(
        toml(f'[model]\nsource = "{bad}"')
    )


def test_a_repo_id_the_hub_accepts_is_kept() -> None:
    for good in ("Qwen/Qwen3-8B", "org_1/name.v2-x", "a/b"):
        spec = load_spec(toml(f'[model]\nsource = "{good}"'), source="farm.toml")
        assert spec.model is not None and spec.model.source == good
