"""sglang.flags' advice for renamed flags, pinned word for word (issue 27: mutation testing
found these rules unheld): a log's advice when the SGLang version is unknown, and the hint
when the installed SGLang is known."""

# ruff: noqa: E501  # the messages are pinned whole, one a line, as they read

from __future__ import annotations

import pytest

from sglang_farm.sglang.flags import (
    RENAMES,
    _before,
    flag_key,
    log_advice,
    unknown_flag_hint,
)

OLD, NEW = (0, 5, 12), (0, 5, 23)

LOG_ADVICE = {
    "mamba_scheduler_strategy": "`mamba_scheduler_strategy` was renamed in SGLang 0.5.23: in the farm config write `mamba_radix_cache_strategy` instead (same values).",
    "mamba_radix_cache_strategy": "`mamba_radix_cache_strategy` is the spelling of SGLang >= 0.5.23; SGLang <= 0.5.22 calls it `mamba_scheduler_strategy`: write `mamba_scheduler_strategy` in the farm config for this SGLang.",
    "cuda_graph_max_bs": "`cuda_graph_max_bs` was removed from SGLang in 0.5.23: use `cuda_graph_max_bs_decode` and/or `cuda_graph_max_bs_prefill` in the farm config instead.",
    "cuda_graph_max_bs_decode": "`cuda_graph_max_bs_decode` is the spelling of SGLang >= 0.5.23; SGLang <= 0.5.22 calls it `cuda_graph_max_bs`: write `cuda_graph_max_bs` in the farm config for this SGLang.",
    "disable_cuda_graph": "`disable_cuda_graph` is deprecated since SGLang 0.5.23: write cuda_graph_backend_decode = 'disabled' and cuda_graph_backend_prefill = 'disabled' instead.",
    "cuda_graph_backend_decode": "`cuda_graph_backend_decode` came with SGLang 0.5.23; SGLang <= 0.5.22 has `disable_cuda_graph` instead.",
    "tp_size": None,
}

HINTS = {
    ("mamba_scheduler_strategy", OLD): None,
    ("mamba_scheduler_strategy", NEW): (
        "SGLang 0.5.23 calls it --mamba-radix-cache-strategy",
        "write mamba_radix_cache_strategy instead of mamba_scheduler_strategy in [sglang] (same values)",
    ),
    ("mamba_radix_cache_strategy", OLD): (
        "SGLang 0.5.12 calls it --mamba-scheduler-strategy",
        "write mamba_scheduler_strategy instead of mamba_radix_cache_strategy in [sglang] (same values)",
    ),
    ("mamba_radix_cache_strategy", NEW): None,
    ("cuda_graph_max_bs", OLD): None,
    ("cuda_graph_max_bs", NEW): (
        "SGLang 0.5.23 has no --cuda-graph-max-bs (replaced by --cuda-graph-max-bs-decode and --cuda-graph-max-bs-prefill in SGLang 0.5.23)",
        "write cuda_graph_max_bs_decode and/or cuda_graph_max_bs_prefill instead of cuda_graph_max_bs in [sglang]",
    ),
    ("cuda_graph_max_bs_decode", OLD): (
        "SGLang 0.5.12 calls it --cuda-graph-max-bs",
        "write cuda_graph_max_bs instead of cuda_graph_max_bs_decode in [sglang] (same values)",
    ),
    ("cuda_graph_max_bs_decode", NEW): None,
    ("disable_cuda_graph", OLD): None,
    ("disable_cuda_graph", NEW): None,
    ("cuda_graph_backend_decode", OLD): (
        "SGLang 0.5.12 has no --cuda-graph-backend-decode (it came with SGLang 0.5.23); SGLang 0.5.12 has --disable-cuda-graph",
        "write disable_cuda_graph instead of cuda_graph_backend_decode in [sglang] (see `--help` for its values)",
    ),
    ("cuda_graph_backend_decode", NEW): None,
    ("tp_size", OLD): None,
    ("tp_size", NEW): None,
}


@pytest.mark.parametrize("key", sorted(LOG_ADVICE))
def test_log_advice_names_the_other_spelling(key: str) -> None:
    assert log_advice(key) == LOG_ADVICE[key]


@pytest.mark.parametrize(("key", "version"), sorted(HINTS))
def test_unknown_flag_hint_says_what_this_sglang_calls_it(
    key: str, version: tuple[int, int, int]
) -> None:
    assert unknown_flag_hint(key, version) == HINTS[key, version]


def test_the_release_before_is_the_last_number_less_one() -> None:
    assert _before((0, 5, 23)) == (0, 5, 22)
    assert _before((0, 5, 1)) == (0, 5, 0)
    assert _before((0, 6, 0)) == (0, 6, 0)  # unknown: the table writes such a bound itself
    assert _before(()) == ()


def test_flag_key_reads_the_key_of_a_flag() -> None:
    assert flag_key("--mem-fraction-static=0.8") == "mem_fraction_static"
    assert flag_key("--tp-size") == "tp_size"


def test_only_a_rename_with_an_end_is_removed() -> None:
    assert {r.old: r.removed for r in RENAMES} == {
        "mamba_scheduler_strategy": True,
        "cuda_graph_max_bs": True,
        "disable_cuda_graph": False,
    }
