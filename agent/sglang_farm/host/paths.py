"""Pure: where the farm's files live on a host, named once (docs/install.md lists them)."""

from __future__ import annotations

DEFAULT_CONFIG_PATH = "/etc/sglang-farm/farm.toml"  # the one config file (a conffile)
DEFAULT_SOCKET = "/run/sglang-farm/control.sock"  # farmctl's control socket
DEFAULT_STATE_DIR = "/var/lib/sglang-farm"  # what survives an agent restart
DEFAULT_AGENT_BIN = "/usr/bin/sglang-farm"  # the packaged agent
