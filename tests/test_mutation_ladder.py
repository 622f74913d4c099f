"""The OOM ladder's rules that mutation testing found unheld (issue 27): list values
shown, a float's upper bound, the last step described, a zero factor, the sign of an add."""

from __future__ import annotations

from sglang_farm.sglang.ladder import FlagChange, apply_ladder, describe_step
from sglang_farm.spec import OomAdjust, OomStep


def test_a_list_value_reads_as_a_list() -> None:
    change = FlagChange("cuda_graph_bs", (1, 2), (1, 2, 4), "graphs")
    assert str(change) == "cuda_graph_bs [1, 2] -> [1, 2, 4]"


def test_a_float_adjust_is_clamped_to_its_max() -> None:
    step = OomStep("more", (OomAdjust("mem_fraction_static", add=0.1, max=0.9),))
    flags, _ = apply_ladder({"mem_fraction_static": 0.85}, (step,), 1)
    assert flags["mem_fraction_static"] == 0.9


def test_a_zero_factor_gives_zero() -> None:
    steps = (
        OomStep("f", (OomAdjust("mem_fraction_static", multiply=0.0),)),
        OomStep("i", (OomAdjust("max_running_requests", multiply=0.0),)),
    )
    flags, _ = apply_ladder({"mem_fraction_static": 0.8, "max_running_requests": 64}, steps, 2)
    assert flags == {"mem_fraction_static": 0.0, "max_running_requests": 0}


def test_the_last_step_is_described() -> None:
    steps = (OomStep("a", (OomAdjust("x", set=1),)), OomStep("b", (OomAdjust("y", set=2),)))
    assert describe_step(steps, 2) == "step 2/2 'b': y = 2"


def test_an_add_under_one_keeps_its_sign() -> None:
    def line(add: float) -> str:
        return describe_step((OomStep("s", (OomAdjust("chunked_prefill_size", add=add),)),), 1)

    assert line(0.5) == "step 1/1 's': chunked_prefill_size +0.5"
    assert line(0.0) == "step 1/1 's': chunked_prefill_size +0"
    assert line(-0.5) == "step 1/1 's': chunked_prefill_size -0.5"
