"""Pure: NVIDIA's XID catalog as one table, and what each code means for a worker's GPU.

Source: NVIDIA, "Analyzing Xid Errors with the Xid Catalog" (Ampere and newer GPUs),
<https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html>, sheet "Xids":
each code's Description and its "Resolution Bucket (Immediate Action)", the action the
catalog says recovers the system; the bucket names (`RESTART_APP`, `RESET_GPU`,
`RESTART_BM`, `IGNORE`, ...) are the catalog's own, and `ACTIONS` quotes its "Fault
Resolution Buckets" sheet. docs/reference/nvml.md §10 explains how the farm reads it.

The farm sorts every code into one of four classes:

- `application`: the worker's own fault (RESTART_APP and the application-fault rows);
  the normal restart policy applies, the GPU stays in service;
- `gpu_reset`: the GPU must be reset before it runs work again (RESET_GPU, and the
  workflows that end in one); the GPU is quarantined;
- `reboot`: the node must be rebooted or serviced, or support contacted (RESTART_BM,
  RESTART_VM, CHECK_MECHANICALS, UPDATE_SWFW, CONTACT_SUPPORT); the GPU is quarantined;
- `informational`: the catalog asks for no immediate action (IGNORE, XID 154).

A code the table does not hold (a driver newer than the table) is `gpu_reset`: NVML only
reports XIDs it calls critical, and quarantining costs one check by the operator
(`farmctl release-gpu`, which re-checks the GPU through NVML), whereas guessing
`application` would reload the model again and again onto hardware that may be broken.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

__all__ = [
    "ACTIONS",
    "CATALOG",
    "CATALOG_URL",
    "XidClass",
    "XidInfo",
    "classify",
    "next_step",
    "quarantine_reason",
    "quarantines",
]

CATALOG_URL: Final = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


class XidClass(StrEnum):
    APPLICATION = "application"
    GPU_RESET = "gpu_reset"
    REBOOT = "reboot"
    INFORMATIONAL = "informational"


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One row of the catalog, with the farm's class for it."""

    code: int
    xid_class: XidClass
    meaning: str  # the catalog's Description
    action: str  # the catalog's Resolution Bucket (Immediate Action); "" where it gives none
    note: str = ""  # why the farm's class differs from the bare bucket, or the catalog's advice
    known: bool = True  # False: not in the table (see `classify`)

    @property
    def quarantines(self) -> bool:
        """True when the GPU must leave service until an operator resets or reboots."""
        return self.xid_class in (XidClass.GPU_RESET, XidClass.REBOOT)

    @property
    def action_text(self) -> str:
        """The catalog's action, its bucket name and the bucket's resolution text.

        No final period, so callers can go on with a sentence of their own."""
        if not self.action:
            return "the catalog gives no immediate action"
        text = ACTIONS.get(self.action, "").rstrip(".")
        return f"{self.action}: {text}" if text else self.action


# The "Fault Resolution Buckets" sheet, for the immediate actions the table uses (its
# wording, punctuation added; workflows condensed). The catalog's own text for RESET_GPU
# reads "Refer to RESTART_BM is not deemed necessary." (a fragment); the entry below says
# what the bucket name says.
ACTIONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "RESTART_APP": "The application should be restarted; RESET_GPU or RESTART_BM is not "
        "deemed necessary.",
        "RESET_GPU": "Reset the GPU; RESTART_BM is not deemed necessary.",
        "RESTART_BM": "Restart bare metal, system should be restarted.",
        "RESTART_VM": "VM owning the affected GPU must be restarted.",
        "IGNORE": "No Action required.",
        "CONTACT_SUPPORT": "Please contact your support organization for further investigation.",
        "CHECK_MECHANICALS": "Check to ensure that device seating and all applicable "
        "connections to it are secure.",
        "UPDATE_SWFW": "Update Firmware and Software to latest versions.",
        "CHECK_UVM": "If UVM/vGPU is being utilized, RESET_GPU; otherwise IGNORE.",
        "XID_154": "Follow XID 154 reported guidance.",
        "WORKFLOW_XID_45": "Solo: RESTART_FM. Not Solo: IGNORE (follow guidance in other Xid).",
        "WORKFLOW_XID_48": "Solo: RESET_GPU; with 63 or 64: DRAIN_AND_RESET.",
        "WORKFLOW_NVLINK_ERR": "Decode the Xid's registers; a GPU reset or node reboot is "
        "needed to clear this error.",
        "WORKFLOW_NVLINK5_ERR": "Decode the Xid message (XID 144-150 Decode sheet) to derive "
        "the resolution.",
    }
)

_A, _R, _B, _I = (
    XidClass.APPLICATION,
    XidClass.GPU_RESET,
    XidClass.REBOOT,
    XidClass.INFORMATIONAL,
)


def _x(code: int, cls: XidClass, meaning: str, action: str, note: str = "") -> XidInfo:
    return XidInfo(code, cls, meaning, action, note)


def _unused(*codes: int) -> tuple[XidInfo, ...]:
    # "Unused" rows: deprecated, or V100 and older; the catalog's action is CONTACT_SUPPORT.
    # One reported on a current GPU is unexpected, so the GPU leaves service.
    return tuple(_x(c, _B, "Unused", "CONTACT_SUPPORT") for c in codes)


_NVLINK5 = (
    "NVLink 5 (B100/GB200 only); the action depends on the message's subcode, which an NVML "
    "event does not carry, so the farm takes the reset its fatal subcodes need"
)

_ROWS: Final[tuple[XidInfo, ...]] = (
    *_unused(1, 2, 3, 4, 5, 6, 7),
    _x(8, _A, "GPU stopped processing", "RESTART_APP"),
    *_unused(9, 10),
    _x(11, _A, "Invalid or corrupted push buffer stream", "RESTART_APP"),
    *_unused(12),
    _x(13, _A, "Graphics Engine Exception", "RESTART_APP", "general user application faults"),
    _x(14, _I, "Fake or injected error from userspace", "IGNORE"),
    *_unused(15, 16, 17, 18, 19, 20, 21, 22, 23, 24),
    _x(25, _A, "Invalid or illegal push buffer stream", "RESTART_APP"),
    *_unused(26, 27, 28, 29, 30),
    _x(31, _A, "GPU memory page fault", "RESTART_APP", "typically application-level bugs"),
    _x(32, _A, "Invalid or corrupted push buffer stream", "RESTART_APP"),
    *_unused(33, 34, 35, 36),
    _x(37, _I, "Driver firmware error", "IGNORE"),
    _x(38, _I, "Driver firmware error", "IGNORE"),
    _x(39, _A, "Copy Engine Exception", "RESTART_APP"),
    _x(40, _A, "Copy Engine Exception", "RESTART_APP"),
    _x(41, _A, "Copy Engine Exception", "RESTART_APP"),
    *_unused(42),
    _x(
        43,
        _A,
        "GPU stopped processing",
        "IGNORE",
        "a user application hit a software induced fault and must terminate; the GPU "
        "remains in a healthy state",
    ),
    _x(44, _I, "Graphics Engine fault during context switch", "IGNORE"),
    _x(
        45,
        _A,
        "Preemptive cleanup, due to previous errors",
        "WORKFLOW_XID_45",
        "the driver tore down an aborted application (Ctrl-C, SIGKILL, GPU reset); "
        "follow the other XID logged with it",
    ),
    _x(46, _R, "GPU stopped processing", "RESET_GPU"),
    *_unused(47),
    _x(
        48,
        _R,
        "Double Bit ECC Error",
        "WORKFLOW_XID_48",
        "a GPU reset or node reboot is needed to clear this error",
    ),
    *_unused(49, 50, 51, 52, 53),
    _x(54, _B, "Auxiliary power is not connected to the GPU board", "CHECK_MECHANICALS"),
    *_unused(55, 56, 57, 58, 59),
    _x(60, _A, "Video processor exception", "RESTART_APP"),
    *_unused(61),
    _x(62, _R, "Internal micro-controller halt", "RESET_GPU"),
    _x(
        63,
        _I,
        "GPU memory remapping event",
        "IGNORE",
        "a row remap pending after it needs a GPU reset: the farm quarantines on NVML's "
        "pending-remap flag, not on this XID",
    ),
    _x(64, _R, "GPU memory remapping failure", "RESET_GPU"),
    *_unused(65),
    _x(66, _I, "Illegal access by driver", "IGNORE"),
    _x(67, _I, "Illegal access by driver", "IGNORE"),
    _x(68, _A, "NVDEC0 Exception", "RESTART_APP"),
    _x(69, _A, "Graphics Engine class error", "RESTART_APP"),
    _x(70, _A, "CE3: Unknown Error", "RESTART_APP"),
    _x(71, _A, "CE4: Unknown Error", "RESTART_APP"),
    _x(72, _A, "CE5: Unknown Error", "RESTART_APP"),
    *_unused(73),
    _x(
        74,
        _R,
        "NVLINK Error",
        "WORKFLOW_NVLINK_ERR",
        "a GPU reset or node reboot is needed to clear this error; the fault may be at the "
        "other end of the link",
    ),
    _x(75, _A, "CE6: Unknown Error", "RESTART_APP"),
    _x(76, _A, "CE7: Unknown Error", "RESTART_APP"),
    _x(77, _A, "CE8: Unknown Error", "RESTART_APP"),
    _x(78, _B, "vGPU Start Error", "UPDATE_SWFW"),
    _x(
        79,
        _B,
        "GPU has fallen off the bus",
        "RESTART_BM",
        "the GPU is not accessible over PCI Express; if it recurs: CONTACT_SUPPORT",
    ),
    _x(80, _A, "Corrupted data sent to GPU", "RESTART_APP"),
    *_unused(81),
    _x(82, _A, "NVJPG0 Error", "RESTART_APP"),
    _x(83, _A, "NVDEC1 Error", "RESTART_APP"),
    _x(84, _A, "NVDEC2 Error", "RESTART_APP"),
    _x(85, _A, "CE9: Unknown Error", "RESTART_APP"),
    _x(86, _A, "OFA Exception", "RESTART_APP"),
    *_unused(87),
    _x(88, _A, "NVDEC3 Error", "RESTART_APP"),
    _x(89, _A, "NVDEC4 Error", "RESTART_APP"),
    *_unused(90, 91),
    _x(92, _I, "High single-bit ECC error rate", "IGNORE", "if it recurs: CONTACT_SUPPORT"),
    _x(93, _I, "Non-fatal violation of provisioned InfoROM wear limit", "IGNORE"),
    _x(
        94,
        _A,
        "Contained memory error",
        "RESTART_APP",
        "contained to one application, which must be restarted; reset the GPU when "
        "convenient, applications can run until then",
    ),
    _x(
        95,
        _R,
        "Uncontained memory error",
        "RESET_GPU",
        "affects multiple applications; the GPU must be reset before applications can restart",
    ),
    _x(96, _A, "NVDEC5 Error", "RESTART_APP"),
    _x(97, _A, "NVDEC6 Error", "RESTART_APP"),
    _x(98, _A, "NVDEC7 Error", "RESTART_APP"),
    _x(99, _A, "NVJPG1 Error", "RESTART_APP"),
    _x(100, _A, "NVJPG2 Error", "RESTART_APP"),
    _x(101, _A, "NVJPG3 Error", "RESTART_APP"),
    _x(102, _A, "NVJPG4 Error", "RESTART_APP"),
    _x(103, _A, "NVJPG5 Error", "RESTART_APP"),
    _x(104, _A, "NVJPG6 Error", "RESTART_APP"),
    _x(105, _A, "NVJPG7 Error", "RESTART_APP"),
    _x(106, _I, "SMBPBI Test Message", "IGNORE"),
    _x(107, _I, "SMBPBI Test Message Silent", "IGNORE"),
    _x(108, _I, "Unused", "IGNORE"),
    _x(109, _R, "Context Switch Timeout Error", "RESET_GPU"),
    _x(
        110,
        _R,
        "Security Fault Error",
        "RESET_GPU",
        "uncommon unless there is a hardware failure; the catalog advises a cold reset of "
        "the system",
    ),
    *_unused(111, 112, 113, 114, 115, 116, 117, 118),
    _x(
        119,
        _R,
        "GSP RPC Timeout",
        "RESET_GPU",
        "a GPU reset or node power cycle may be needed if the error persists",
    ),
    _x(
        120,
        _R,
        "GSP Error",
        "RESET_GPU",
        "a GPU reset or node power cycle may be needed if the error persists",
    ),
    _x(121, _I, "C2C Error", "IGNORE", "corrected errors on the C2C link to a Grace CPU"),
    *_unused(122, 123, 124, 125),
    _x(126, _A, "CE10: Unknown Error", "RESTART_APP"),
    _x(127, _A, "CE11: Unknown Error", "RESTART_APP"),
    _x(128, _A, "CE12: Unknown Error", "RESTART_APP"),
    _x(129, _A, "CE13: Unknown Error", "RESTART_APP"),
    _x(130, _A, "CE14: Unknown Error", "RESTART_APP"),
    _x(131, _A, "CE15: Unknown Error", "RESTART_APP"),
    _x(132, _A, "CE16: Unknown Error", "RESTART_APP"),
    _x(133, _A, "CE17: Unknown Error", "RESTART_APP"),
    _x(134, _A, "CE18: Unknown Error", "RESTART_APP"),
    _x(135, _A, "CE19: Unknown Error", "RESTART_APP"),
    _x(136, _R, "Link Training Failed", "RESET_GPU"),
    _x(
        137,
        _A,
        "NVLink Privilege Error",
        "IGNORE",
        "an illegal NVLink peer-to-peer access; typically application-level bugs",
    ),
    *_unused(138),
    _x(139, _A, "OFA1 Error", "RESTART_APP"),
    _x(140, _R, "ECC Unrecovered Error", "RESET_GPU"),
    _x(141, _I, "CUDA Fast Path Error", "IGNORE"),
    _x(142, _B, "NVENC3 Error", "CONTACT_SUPPORT"),
    _x(143, _R, "GPU Initialization Error", "RESET_GPU"),
    _x(144, _R, "NVLINK: SAW Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _x(145, _R, "NVLINK: RLW Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _x(146, _R, "NVLINK: TLW Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _x(147, _R, "NVLINK: TREX Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _x(148, _R, "NVLINK: NVLPW_CTRL Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _x(149, _R, "NVLINK: NETIR Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _x(150, _R, "NVLINK: MSE Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _x(151, _B, "Key rotation Error", "RESTART_VM"),
    _x(152, _I, "DLA SMMU Error", "IGNORE"),
    _x(153, _I, "DLA timeout Error", "IGNORE"),
    _x(
        154,
        _I,
        "GPU Recovery Action Changed",
        "XID_154",
        "informational only: always logged with another XID, whose own class decides",
    ),
    _x(155, _R, "NVLINK: SW Defined Error", "RESET_GPU"),
    _x(156, _R, "Resource Retirement Event", "RESET_GPU"),
    _x(157, _I, "Resource Retirement Failure", "IGNORE"),
    _x(158, _R, "GPU Fatal Timeout", "RESET_GPU"),
    _x(
        159,
        _R,
        "CHI Non-Data Error",
        "CHECK_UVM",
        "every CUDA process uses UVM, so the farm takes the reset",
    ),
    _x(160, _I, "Channel Retirement Event", "IGNORE"),
    _x(161, _I, "Channel Retirement Failure", "IGNORE"),
    _x(162, _I, "Power Smoothing HW Circuitry capability reengaged", ""),
    _x(
        163,
        _I,
        "Power Smoothing HW Circuitry capability disengaged",
        "",
        "no GPU reset required",
    ),
    _x(164, _I, "Power Smoothing HW Circuitry low lifetime reached", "", "monitor power swings"),
    _x(165, _I, "Power Smoothing HW Circuitry lifetime exhausted", "", "monitor power swings"),
    _x(
        166,
        _R,
        "CC traffic seen prior to link properly being configured for encrypted traffic",
        "",
        "confidential computing mode only; no action given: the unknown-code default",
    ),
    _x(167, _R, "PCIE_FATAL_TIMEOUT", "", "no action given: the unknown-code default"),
    _x(
        168,
        _B,
        "Errors found in WPR (write protected region)",
        "",
        "seen only with ECC disabled: enable ECC, or boot again",
    ),
    _x(169, _R, "Internal micro-controller halt", "", "no action given: as XID 62"),
    _x(
        170,
        _R,
        "Interrupt seen in CC mode",
        "",
        "confidential computing mode only; no action given: the unknown-code default",
    ),
    _x(171, _R, "Uncorrectable DRAM error (details of an XID 48)", "", "follow XID 48"),
    _x(172, _R, "Uncorrectable SRAM error (details of an XID 48)", "", "follow XID 48"),
)

CATALOG: Final[Mapping[int, XidInfo]] = MappingProxyType({x.code: x for x in _ROWS})


def classify(code: int) -> XidInfo:
    """The catalog's row for `code`; a code it does not hold is `gpu_reset` (module docstring)."""
    info = CATALOG.get(code)
    if info is not None:
        return info
    return XidInfo(
        code,
        XidClass.GPU_RESET,
        "not in the farm's copy of NVIDIA's XID catalog",
        "",
        "unknown code: treated as needing a GPU reset until an operator checks it",
        known=False,
    )


def quarantines(code: int) -> bool:
    """True when XID `code` takes its GPU out of service (class gpu_reset or reboot)."""
    return classify(code).quarantines


def quarantine_reason(code: int) -> str:
    """The quarantine's `reason` for XID `code`, as status, metrics and alerts show it."""
    return f"xid {code}"


def next_step(code: int, gpu: int) -> str:
    """What the operator does next about XID `code` on GPU `gpu`, for `farmctl why`."""
    info = classify(code)
    head = f"XID {code} ({info.meaning}); NVIDIA's action: {info.action_text}"
    release = f"then `farmctl release-gpu {gpu}` re-checks the GPU and starts its worker."
    if info.xid_class is XidClass.GPU_RESET:
        return (
            f"{head}. Reset GPU {gpu} once no process holds it "
            f"(`nvidia-smi --query-compute-apps=pid --format=csv -i {gpu}` lists none): "
            f"`sudo nvidia-smi -r -i {gpu}`; if the reset is refused or the XID comes back, "
            f"reboot the node; {release}"
        )
    if info.xid_class is XidClass.REBOOT:
        return (
            f"{head}. Reboot the node (a GPU reset does not recover this); if the XID comes "
            f"back after the reboot, contact your support organization; {release}"
        )
    if info.xid_class is XidClass.APPLICATION:
        return (
            f"{head}. Nothing to do for the GPU: the worker restarts under the normal restart "
            f"policy; if the XID repeats, look at the application (`farmctl why`)."
        )
    return f"{head}. Nothing to do: the GPU stays in service."
