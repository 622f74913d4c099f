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

# Short names for the classes, so that each row of the table below fits on a line.
_APP, _RESET, _REBOOT, _INFO = (
    XidClass.APPLICATION,
    XidClass.GPU_RESET,
    XidClass.REBOOT,
    XidClass.INFORMATIONAL,
)


def _row(code: int, cls: XidClass, meaning: str, action: str, note: str = "") -> XidInfo:
    """One row of the catalog: code, the farm's class, Description, Immediate Action."""
    return XidInfo(code, cls, meaning, action, note)


def _unused(*codes: int) -> tuple[XidInfo, ...]:
    # "Unused" rows: deprecated, or V100 and older; the catalog's action is CONTACT_SUPPORT.
    # One reported on a current GPU is unexpected, so the GPU leaves service.
    return tuple(_row(c, _REBOOT, "Unused", "CONTACT_SUPPORT") for c in codes)


_NVLINK5 = (
    "NVLink 5 (B100/GB200 only); the action depends on the message's subcode, which an NVML "
    "event does not carry, so the farm takes the reset its fatal subcodes need"
)

_ROWS: Final[tuple[XidInfo, ...]] = (
    *_unused(1, 2, 3, 4, 5, 6, 7),
    _row(8, _APP, "GPU stopped processing", "RESTART_APP"),
    *_unused(9, 10),
    _row(11, _APP, "Invalid or corrupted push buffer stream", "RESTART_APP"),
    *_unused(12),
    _row(13, _APP, "Graphics Engine Exception", "RESTART_APP", "general user application faults"),
    _row(14, _INFO, "Fake or injected error from userspace", "IGNORE"),
    *_unused(15, 16, 17, 18, 19, 20, 21, 22, 23, 24),
    _row(25, _APP, "Invalid or illegal push buffer stream", "RESTART_APP"),
    *_unused(26, 27, 28, 29, 30),
    _row(31, _APP, "GPU memory page fault", "RESTART_APP", "typically application-level bugs"),
    _row(32, _APP, "Invalid or corrupted push buffer stream", "RESTART_APP"),
    *_unused(33, 34, 35, 36),
    _row(37, _INFO, "Driver firmware error", "IGNORE"),
    _row(38, _INFO, "Driver firmware error", "IGNORE"),
    _row(39, _APP, "Copy Engine Exception", "RESTART_APP"),
    _row(40, _APP, "Copy Engine Exception", "RESTART_APP"),
    _row(41, _APP, "Copy Engine Exception", "RESTART_APP"),
    *_unused(42),
    _row(
        43,
        _APP,
        "GPU stopped processing",
        "IGNORE",
        "a user application hit a software induced fault and must terminate; the GPU "
        "remains in a healthy state",
    ),
    _row(44, _INFO, "Graphics Engine fault during context switch", "IGNORE"),
    _row(
        45,
        _APP,
        "Preemptive cleanup, due to previous errors",
        "WORKFLOW_XID_45",
        "the driver tore down an aborted application (Ctrl-C, SIGKILL, GPU reset); "
        "follow the other XID logged with it",
    ),
    _row(46, _RESET, "GPU stopped processing", "RESET_GPU"),
    *_unused(47),
    _row(
        48,
        _RESET,
        "Double Bit ECC Error",
        "WORKFLOW_XID_48",
        "a GPU reset or node reboot is needed to clear this error",
    ),
    *_unused(49, 50, 51, 52, 53),
    _row(54, _REBOOT, "Auxiliary power is not connected to the GPU board", "CHECK_MECHANICALS"),
    *_unused(55, 56, 57, 58, 59),
    _row(60, _APP, "Video processor exception", "RESTART_APP"),
    *_unused(61),
    _row(62, _RESET, "Internal micro-controller halt", "RESET_GPU"),
    _row(
        63,
        _INFO,
        "GPU memory remapping event",
        "IGNORE",
        "a row remap pending after it needs a GPU reset: the farm quarantines on NVML's "
        "pending-remap flag, not on this XID",
    ),
    _row(64, _RESET, "GPU memory remapping failure", "RESET_GPU"),
    *_unused(65),
    _row(66, _INFO, "Illegal access by driver", "IGNORE"),
    _row(67, _INFO, "Illegal access by driver", "IGNORE"),
    _row(68, _APP, "NVDEC0 Exception", "RESTART_APP"),
    _row(69, _APP, "Graphics Engine class error", "RESTART_APP"),
    _row(70, _APP, "CE3: Unknown Error", "RESTART_APP"),
    _row(71, _APP, "CE4: Unknown Error", "RESTART_APP"),
    _row(72, _APP, "CE5: Unknown Error", "RESTART_APP"),
    *_unused(73),
    _row(
        74,
        _RESET,
        "NVLINK Error",
        "WORKFLOW_NVLINK_ERR",
        "a GPU reset or node reboot is needed to clear this error; the fault may be at the "
        "other end of the link",
    ),
    _row(75, _APP, "CE6: Unknown Error", "RESTART_APP"),
    _row(76, _APP, "CE7: Unknown Error", "RESTART_APP"),
    _row(77, _APP, "CE8: Unknown Error", "RESTART_APP"),
    _row(78, _REBOOT, "vGPU Start Error", "UPDATE_SWFW"),
    _row(
        79,
        _REBOOT,
        "GPU has fallen off the bus",
        "RESTART_BM",
        "the GPU is not accessible over PCI Express; if it recurs: CONTACT_SUPPORT",
    ),
    _row(80, _APP, "Corrupted data sent to GPU", "RESTART_APP"),
    *_unused(81),
    _row(82, _APP, "NVJPG0 Error", "RESTART_APP"),
    _row(83, _APP, "NVDEC1 Error", "RESTART_APP"),
    _row(84, _APP, "NVDEC2 Error", "RESTART_APP"),
    _row(85, _APP, "CE9: Unknown Error", "RESTART_APP"),
    _row(86, _APP, "OFA Exception", "RESTART_APP"),
    *_unused(87),
    _row(88, _APP, "NVDEC3 Error", "RESTART_APP"),
    _row(89, _APP, "NVDEC4 Error", "RESTART_APP"),
    *_unused(90, 91),
    _row(92, _INFO, "High single-bit ECC error rate", "IGNORE", "if it recurs: CONTACT_SUPPORT"),
    _row(93, _INFO, "Non-fatal violation of provisioned InfoROM wear limit", "IGNORE"),
    _row(
        94,
        _APP,
        "Contained memory error",
        "RESTART_APP",
        "contained to one application, which must be restarted; reset the GPU when "
        "convenient, applications can run until then",
    ),
    _row(
        95,
        _RESET,
        "Uncontained memory error",
        "RESET_GPU",
        "affects multiple applications; the GPU must be reset before applications can restart",
    ),
    _row(96, _APP, "NVDEC5 Error", "RESTART_APP"),
    _row(97, _APP, "NVDEC6 Error", "RESTART_APP"),
    _row(98, _APP, "NVDEC7 Error", "RESTART_APP"),
    _row(99, _APP, "NVJPG1 Error", "RESTART_APP"),
    _row(100, _APP, "NVJPG2 Error", "RESTART_APP"),
    _row(101, _APP, "NVJPG3 Error", "RESTART_APP"),
    _row(102, _APP, "NVJPG4 Error", "RESTART_APP"),
    _row(103, _APP, "NVJPG5 Error", "RESTART_APP"),
    _row(104, _APP, "NVJPG6 Error", "RESTART_APP"),
    _row(105, _APP, "NVJPG7 Error", "RESTART_APP"),
    _row(106, _INFO, "SMBPBI Test Message", "IGNORE"),
    _row(107, _INFO, "SMBPBI Test Message Silent", "IGNORE"),
    _row(108, _INFO, "Unused", "IGNORE"),
    _row(109, _RESET, "Context Switch Timeout Error", "RESET_GPU"),
    _row(
        110,
        _RESET,
        "Security Fault Error",
        "RESET_GPU",
        "uncommon unless there is a hardware failure; the catalog advises a cold reset of "
        "the system",
    ),
    *_unused(111, 112, 113, 114, 115, 116, 117, 118),
    _row(
        119,
        _RESET,
        "GSP RPC Timeout",
        "RESET_GPU",
        "a GPU reset or node power cycle may be needed if the error persists",
    ),
    _row(
        120,
        _RESET,
        "GSP Error",
        "RESET_GPU",
        "a GPU reset or node power cycle may be needed if the error persists",
    ),
    _row(121, _INFO, "C2C Error", "IGNORE", "corrected errors on the C2C link to a Grace CPU"),
    *_unused(122, 123, 124, 125),
    _row(126, _APP, "CE10: Unknown Error", "RESTART_APP"),
    _row(127, _APP, "CE11: Unknown Error", "RESTART_APP"),
    _row(128, _APP, "CE12: Unknown Error", "RESTART_APP"),
    _row(129, _APP, "CE13: Unknown Error", "RESTART_APP"),
    _row(130, _APP, "CE14: Unknown Error", "RESTART_APP"),
    _row(131, _APP, "CE15: Unknown Error", "RESTART_APP"),
    _row(132, _APP, "CE16: Unknown Error", "RESTART_APP"),
    _row(133, _APP, "CE17: Unknown Error", "RESTART_APP"),
    _row(134, _APP, "CE18: Unknown Error", "RESTART_APP"),
    _row(135, _APP, "CE19: Unknown Error", "RESTART_APP"),
    _row(136, _RESET, "Link Training Failed", "RESET_GPU"),
    _row(
        137,
        _APP,
        "NVLink Privilege Error",
        "IGNORE",
        "an illegal NVLink peer-to-peer access; typically application-level bugs",
    ),
    *_unused(138),
    _row(139, _APP, "OFA1 Error", "RESTART_APP"),
    _row(140, _RESET, "ECC Unrecovered Error", "RESET_GPU"),
    _row(141, _INFO, "CUDA Fast Path Error", "IGNORE"),
    _row(142, _REBOOT, "NVENC3 Error", "CONTACT_SUPPORT"),
    _row(143, _RESET, "GPU Initialization Error", "RESET_GPU"),
    _row(144, _RESET, "NVLINK: SAW Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _row(145, _RESET, "NVLINK: RLW Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _row(146, _RESET, "NVLINK: TLW Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _row(147, _RESET, "NVLINK: TREX Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _row(148, _RESET, "NVLINK: NVLPW_CTRL Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _row(149, _RESET, "NVLINK: NETIR Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _row(150, _RESET, "NVLINK: MSE Error", "WORKFLOW_NVLINK5_ERR", _NVLINK5),
    _row(151, _REBOOT, "Key rotation Error", "RESTART_VM"),
    _row(152, _INFO, "DLA SMMU Error", "IGNORE"),
    _row(153, _INFO, "DLA timeout Error", "IGNORE"),
    _row(
        154,
        _INFO,
        "GPU Recovery Action Changed",
        "XID_154",
        "informational only: always logged with another XID, whose own class decides",
    ),
    _row(155, _RESET, "NVLINK: SW Defined Error", "RESET_GPU"),
    _row(156, _RESET, "Resource Retirement Event", "RESET_GPU"),
    _row(157, _INFO, "Resource Retirement Failure", "IGNORE"),
    _row(158, _RESET, "GPU Fatal Timeout", "RESET_GPU"),
    _row(
        159,
        _RESET,
        "CHI Non-Data Error",
        "CHECK_UVM",
        "every CUDA process uses UVM, so the farm takes the reset",
    ),
    _row(160, _INFO, "Channel Retirement Event", "IGNORE"),
    _row(161, _INFO, "Channel Retirement Failure", "IGNORE"),
    _row(162, _INFO, "Power Smoothing HW Circuitry capability reengaged", ""),
    _row(
        163,
        _INFO,
        "Power Smoothing HW Circuitry capability disengaged",
        "",
        "no GPU reset required",
    ),
    _row(
        164, _INFO, "Power Smoothing HW Circuitry low lifetime reached", "", "monitor power swings"
    ),
    _row(165, _INFO, "Power Smoothing HW Circuitry lifetime exhausted", "", "monitor power swings"),
    _row(
        166,
        _RESET,
        "CC traffic seen prior to link properly being configured for encrypted traffic",
        "",
        "confidential computing mode only; no action given: the unknown-code default",
    ),
    _row(167, _RESET, "PCIE_FATAL_TIMEOUT", "", "no action given: the unknown-code default"),
    _row(
        168,
        _REBOOT,
        "Errors found in WPR (write protected region)",
        "",
        "seen only with ECC disabled: enable ECC, or boot again",
    ),
    _row(169, _RESET, "Internal micro-controller halt", "", "no action given: as XID 62"),
    _row(
        170,
        _RESET,
        "Interrupt seen in CC mode",
        "",
        "confidential computing mode only; no action given: the unknown-code default",
    ),
    _row(171, _RESET, "Uncorrectable DRAM error (details of an XID 48)", "", "follow XID 48"),
    _row(172, _RESET, "Uncorrectable SRAM error (details of an XID 48)", "", "follow XID 48"),
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
