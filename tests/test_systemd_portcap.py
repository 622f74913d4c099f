"""Issue 30 item 4 under a real systemd: what the units' CAP_NET_BIND_SERVICE lines do
once `net.ipv4.ip_unprivileged_port_start` is raised above the farm's ports.

In the container's own network namespace (the sysctl is per namespace; the host's is
left alone) the sysctl is raised to 31004, above a farm whose workers listen on 30000+
and NCCL on 31000+. Then, each as a transient unit with the directives the agent renders:
another user (`nobody`, no capability) cannot bind a worker's port; a worker's unit
(`User=` not root, `NoNewPrivileges=`, `CapabilityBoundingSet=` and
`AmbientCapabilities=CAP_NET_BIND_SERVICE`: `runtime.units.render_worker_dropin`) can;
smg's unit (`DynamicUser=`) with the capability binds only without `PrivateUsers=`
(the capability of a user namespace of its own does not count for the host's network
namespace), which is why the gateway's unit drops it for a privileged port.
"""

from __future__ import annotations

import pytest

from sdcontainer import SystemdContainer

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


BIND = (
    "import socket, sys\n"
    "s = socket.socket()\n"
    "try:\n"
    "    s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('bound')\n"
    "except OSError as e:\n"
    "    print('refused', e.errno)\n"
)
CAP = [
    "-p",
    "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
    "-p",
    "AmbientCapabilities=CAP_NET_BIND_SERVICE",
]


def bind_in_unit(c: SystemdContainer, props: list[str], port: int) -> str:
    r = c.run(
        [
            "systemd-run",
            "--wait",
            "--pipe",
            "--quiet",
            "-p",
            "NoNewPrivileges=yes",
            *props,
            "/usr/bin/python3",
            "-I",
            "-c",
            BIND,
            str(port),
        ],
        timeout=60,
    )
    return r.stdout.strip()


def test_the_rendered_capability_lets_the_farm_bind_and_no_one_else(sd: SystemdContainer) -> None:
    sd.run(["sysctl", "-w", "net.ipv4.ip_unprivileged_port_start=31004"])
    try:
        nobody = ["-p", "User=nobody", "-p", "CapabilityBoundingSet=", "-p", "AmbientCapabilities="]
        assert bind_in_unit(sd, nobody, 30005) == "refused 13"  # EACCES: no squat
        assert bind_in_unit(sd, ["-p", "User=nobody", *CAP], 30005) == "bound"  # a worker
        smg = ["-p", "DynamicUser=yes", *CAP]
        assert bind_in_unit(sd, [*smg, "-p", "PrivateUsers=yes"], 30005) == "refused 13"
        assert bind_in_unit(sd, [*smg, "-p", "PrivateUsers=no"], 30005) == "bound"
    finally:
        sd.run(["sysctl", "-w", "net.ipv4.ip_unprivileged_port_start=1024"])
