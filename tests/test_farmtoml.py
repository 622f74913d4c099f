"""The test harnesses' one farm.toml builder (farmtoml.py): what it writes is what it was given."""

from __future__ import annotations

import sys
import tomllib
from typing import Any

import pytest

from farmtoml import merged, rewritten, sim_farm, toml_text
from sglang_farm.config import load_spec


def test_the_text_parses_back_to_the_document_it_was_built_from() -> None:
    doc: dict[str, dict[str, Any]] = {
        "farm": {"name": 'a "quoted" \\ name', "python": "/opt/pŷthon", "env": {"A_B": "1"}},
        "workers": {"gpus": [0, 2], "overrides": {"1": {"sglang": {"api_key": "k"}}}},
        "sglang": {"mem_fraction_static": 0.8, "enable_metrics": True, "tp-size": 2},
        "oom": {"steps": [{"name": "less", "add": {"mem_fraction_static": -0.05}}]},
    }
    assert tomllib.loads(toml_text(doc)) == doc


def test_empty_tables_are_left_out_and_an_unknown_value_is_refused() -> None:
    assert toml_text({"health": {}, "metrics": {"gpu_source": "none"}}) == (
        '[metrics]\ngpu_source = "none"\n'
    )
    with pytest.raises(TypeError, match="no TOML for"):
        toml_text({"farm": {"name": object()}})


def test_tables_merge_key_by_key_and_none_drops_a_key() -> None:
    base = {"health": {"period": "2s", "timeout": "5s"}}
    out = merged(base, {"health": {"period": "1s", "timeout": None}, "gateway": {"mode": "x"}})
    assert out == {"health": {"period": "1s"}, "gateway": {"mode": "x"}}
    assert base == {"health": {"period": "2s", "timeout": "5s"}}  # the base is left as it was


def test_the_sim_farm_is_a_valid_config_on_the_gpus_given() -> None:
    spec = load_spec(toml_text(sim_farm(3, sys.executable)), source="t.toml")
    assert [w.gpus for w in spec.workers] == [(0,), (1,), (2,)]
    text = toml_text(sim_farm([0, 5], sys.executable, workers={"base_port": 32000}))
    spec = load_spec(text, source="t.toml")
    assert [(w.gpus, w.port) for w in spec.workers] == [((0,), 32000), ((5,), 32001)]


def test_a_rewritten_config_changes_only_the_keys_given() -> None:
    text = toml_text(sim_farm(2, sys.executable, metrics={"gpu_source": "none"}))
    again = tomllib.loads(rewritten(text, sglang={"api_key": "k"}))
    assert again == merged(tomllib.loads(text), {"sglang": {"api_key": "k"}})
    assert again["sglang"] == {"model_path": "sim/model", "api_key": "k"}
