"""The XID table: each code's class as NVIDIA's catalog gives it, unknown codes, completeness."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_farm.gpus.xid import (
    ACTIONS,
    CATALOG,
    CATALOG_URL,
    XidClass,
    classify,
    next_step,
    quarantine_reason,
    quarantines,
)

ROOT = Path(__file__).resolve().parent.parent
# The catalog's codes run 1..172 (Ampere and newer); every one of them has a row.
CATALOG_CODES = range(1, 173)
DOCS = (
    ROOT / "docs" / "gpu-health.md",
    ROOT / "docs" / "reference" / "nvml.md",
    ROOT / "docs" / "metrics.md",
    ROOT / "etc" / "prometheus" / "alerts.yml",
)


@pytest.mark.parametrize(
    ("code", "cls", "action"),
    [
        # The worker's own fault: restart it under the normal policy.
        (13, XidClass.APPLICATION, "RESTART_APP"),
        (31, XidClass.APPLICATION, "RESTART_APP"),
        (43, XidClass.APPLICATION, "IGNORE"),  # "the GPU remains in a healthy state"
        (45, XidClass.APPLICATION, "WORKFLOW_XID_45"),  # follows the other XID
        (94, XidClass.APPLICATION, "RESTART_APP"),  # contained: reset "when convenient"
        # A GPU reset is needed.
        (48, XidClass.GPU_RESET, "WORKFLOW_XID_48"),
        (64, XidClass.GPU_RESET, "RESET_GPU"),
        (74, XidClass.GPU_RESET, "WORKFLOW_NVLINK_ERR"),
        (95, XidClass.GPU_RESET, "RESET_GPU"),
        (119, XidClass.GPU_RESET, "RESET_GPU"),
        (120, XidClass.GPU_RESET, "RESET_GPU"),
        # The node must be restarted.
        (79, XidClass.REBOOT, "RESTART_BM"),
        # No immediate action in the catalog, whatever folklore says.
        (63, XidClass.INFORMATIONAL, "IGNORE"),
        (92, XidClass.INFORMATIONAL, "IGNORE"),
        (154, XidClass.INFORMATIONAL, "XID_154"),
    ],
)
def test_each_listed_code_has_the_catalogs_class_and_action(
    code: int, cls: XidClass, action: str
) -> None:
    info = classify(code)
    assert (info.code, info.xid_class, info.action, info.known) == (code, cls, action, True)
    assert quarantines(code) is (cls in (XidClass.GPU_RESET, XidClass.REBOOT))


def test_the_catalogs_meaning_is_kept() -> None:
    assert classify(79).meaning == "GPU has fallen off the bus"
    assert classify(48).meaning == "Double Bit ECC Error"
    assert classify(13).meaning == "Graphics Engine Exception"
    assert classify(95).meaning == "Uncontained memory error"


def test_application_and_informational_codes_never_quarantine() -> None:
    for code in (13, 31, 43, 45, 63, 92, 94, 154):
        assert not quarantines(code), code


def test_reset_and_reboot_codes_quarantine() -> None:
    for code in (48, 64, 74, 79, 95, 119, 120):
        assert quarantines(code), code


@pytest.mark.parametrize("code", [0, 173, 999, 22013, -1])
def test_an_unknown_code_is_a_gpu_reset_that_quarantines(code: int) -> None:
    info = classify(code)
    assert info.known is False
    assert info.xid_class is XidClass.GPU_RESET
    assert quarantines(code)
    assert "not in" in info.meaning


def test_the_table_holds_every_code_of_the_catalog_and_nothing_else() -> None:
    assert sorted(CATALOG) == list(CATALOG_CODES)
    assert all(CATALOG[c].code == c for c in CATALOG)


def test_the_class_follows_the_catalogs_bucket_unless_a_note_says_why() -> None:
    by_bucket = {
        "RESTART_APP": XidClass.APPLICATION,
        "RESET_GPU": XidClass.GPU_RESET,
        "RESTART_BM": XidClass.REBOOT,
        "RESTART_VM": XidClass.REBOOT,
        "CONTACT_SUPPORT": XidClass.REBOOT,
        "CHECK_MECHANICALS": XidClass.REBOOT,
        "UPDATE_SWFW": XidClass.REBOOT,
        "IGNORE": XidClass.INFORMATIONAL,
    }
    for info in CATALOG.values():
        want = by_bucket.get(info.action)
        if want is not None and info.xid_class is not want:
            assert info.note, f"XID {info.code}: {info.xid_class} differs from {info.action}"


def test_every_bucket_the_table_uses_has_the_catalogs_text() -> None:
    used = {info.action for info in CATALOG.values() if info.action}
    assert used <= set(ACTIONS), used - set(ACTIONS)
    assert classify(79).action_text == "RESTART_BM: Restart bare metal, system should be restarted"
    assert classify(162).action_text == "the catalog gives no immediate action"


def test_every_xid_the_docs_cite_is_in_the_table_with_the_class_they_give() -> None:
    cited: set[int] = set()
    for doc in DOCS:
        text = doc.read_text()
        cited |= {int(m) for m in re.findall(r"\bXID (\d+)\b", text, re.I)}
        # Table rows "| 79 | `reboot` | ...": the code and the class the doc gives it.
        for code, cls in re.findall(r"^\|\s*(\d+)\s*\|\s*`(\w+)`\s*\|", text, re.M):
            assert classify(int(code)).xid_class == cls, f"{doc.name}: XID {code}"
            cited.add(int(code))
    assert {13, 31, 43, 45, 48, 64, 74, 79, 92, 94, 95, 119, 120} <= cited
    assert cited <= set(CATALOG), cited - set(CATALOG)
    assert CATALOG_URL in (ROOT / "docs" / "gpu-health.md").read_text()


def test_next_step_for_a_reset_names_the_gpu_and_the_reset_command() -> None:
    text = next_step(95, 5)
    assert "`sudo nvidia-smi -r -i 5`" in text
    assert "no process holds it" in text
    assert "reboot the node" in text
    assert "`farmctl release-gpu 5`" in text
    assert "RESET_GPU" in text


def test_next_step_for_a_lost_gpu_is_a_reboot_not_a_reset() -> None:
    text = next_step(79, 2)
    assert "Reboot the node" in text
    assert "nvidia-smi -r" not in text
    assert "RESTART_BM" in text
    assert "`farmctl release-gpu 2`" in text


def test_next_step_for_an_application_fault_leaves_the_gpu_alone() -> None:
    text = next_step(13, 1)
    assert "normal restart policy" in text
    assert "release-gpu" not in text
    assert "Nothing to do" in next_step(63, 1)


def test_the_quarantine_reason_names_the_code() -> None:
    assert quarantine_reason(79) == "xid 79"
