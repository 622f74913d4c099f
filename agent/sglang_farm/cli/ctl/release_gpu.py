"""`farmctl release-gpu`: a quarantined GPU (or worker) taken back into service once the
agent's NVML re-check passes, its worker started again; each problem said when it does not.

One verb: the only way out of a quarantine, by GPU or by worker.
"""

from __future__ import annotations

import click

from sglang_farm.cli.ctl.args import WORKER
from sglang_farm.cli.ctl.connection import Ctl, pass_ctl
from sglang_farm.cli.ctl.exits import BadUsage, Failed
from sglang_farm.cli.ctl.text import who
from sglang_farm.control.client import CHANGE_TIMEOUT


@click.command("release-gpu")
@click.argument("gpu", metavar="[GPU]", type=click.IntRange(min=0), required=False)
@click.option(
    "--worker",
    type=WORKER,
    metavar="N",
    help="Release worker N instead, whichever GPU its quarantine names (a reload moved "
    "it): the GPUs it uses now are the ones re-checked.",
)
@pass_ctl
def release_gpu(ctl: Ctl, gpu: int | None, worker: int | None) -> None:
    """Take a quarantined GPU back into service and start its worker again.

    The agent first re-checks the GPU through NVML: healthy, no row remaps pending,
    memory free, no compute process left. Reset the GPU before this (nvidia-smi -r -i
    GPU, or reboot: farmctl why N says which). Exits 1, printing each problem, when a
    check fails: the quarantine then stays. With --worker N instead of GPU: worker N's
    quarantine, whichever GPU it names.
    """
    if (gpu is None) == (worker is None):
        raise BadUsage(
            "name the GPU (farmctl release-gpu G) or the worker (farmctl release-gpu "
            "--worker N), one of the two; farmctl status shows which is quarantined"
        )
    args = {"gpu": gpu} if worker is None else {"worker": worker}
    res = ctl.call("release-gpu", args, timeout=CHANGE_TIMEOUT)
    if ctl.as_json:
        ctl.emit_json(res)
    held = [int(i) for i in res.get("workers", [])]
    what, again = (
        (f"GPU {gpu}", f"farmctl release-gpu {gpu}")
        if worker is None
        else (f"worker {worker}", f"farmctl release-gpu --worker {worker}")
    )
    if not res.get("released"):
        problems = [str(p) for p in res.get("problems", [])]
        if not ctl.as_json:
            for p in problems:
                click.echo(f"  {p}", err=True)
        stays = f"; {who(held)} stay{'s' if len(held) == 1 else ''} stopped" if held else ""
        raise Failed(
            f"{what} not released: the quarantine stays{stays}; fix what is listed and "
            f"run {again} again"
        )
    if ctl.as_json:
        return
    if not held:
        click.echo(f"{what} released")
        return
    checked = ", ".join(str(int(g)) for g in res.get("checked", []))
    gpus = f" (GPU {checked} checked)" if worker is not None and checked else ""
    click.echo(
        f"{what} released{gpus}: {who(held)} starting again "
        f"(farmctl status shows the progress; farmctl logs {held[0]} -f the output)"
    )
