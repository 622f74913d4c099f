"""procfs: /proc/PID/stat read in one place (a name with spaces and ')' included)."""

from __future__ import annotations

import os
import subprocess
import sys

from sglang_farm.host import procfs

# proc(5): pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt
# cmajflt utime stime cutime cstime priority nice num_threads itrealvalue starttime ...
LINE = "4242 (sglang::sch (a) b) S 17 4242 4240 0 -1 4194560 1 2 3 4 5 6 7 8 20 0 3 0 98765 0 0"


def test_fields_are_read_after_the_last_parenthesis_of_the_name() -> None:
    st = procfs.parse_stat(4242, LINE)
    assert st == procfs.ProcStat(4242, "S", 17, 4242, 4240, 98765)
    assert st is not None and st.alive


def test_a_zombie_is_not_alive_and_a_short_line_is_none() -> None:
    st = procfs.parse_stat(1, LINE.replace(") S ", ") Z "))
    assert st is not None and not st.alive
    assert procfs.parse_stat(1, "1 (x) S 0 1") is None


def test_this_process_and_a_child_as_the_kernel_says() -> None:
    me = procfs.read_stat(os.getpid())
    assert me is not None and me.alive
    assert (me.ppid, me.pgrp, me.session) == (os.getppid(), os.getpgrp(), os.getsid(0))
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as child:
        try:
            st = procfs.read_stat(child.pid)
            assert st is not None and st.ppid == os.getpid() and st.start >= me.start
            assert child.pid in {s.pid for s in procfs.all_stats()}
        finally:
            child.kill()
    assert procfs.read_stat(child.pid) is None  # reaped: gone


def test_a_process_whose_name_is_not_utf8_is_read_and_walked() -> None:
    """Any user may name a process with any bytes (prctl PR_SET_NAME): a name that is
    not UTF-8 raised UnicodeDecodeError out of the walk of every process, so the GPU
    poll's memory attribution and a worker's process tree failed while it ran."""
    code = (
        "import ctypes, sys, time\n"
        "ctypes.CDLL(None).prctl(15, b'\\xff\\xfesquat', 0, 0, 0)\n"
        "print('named', flush=True); time.sleep(30)\n"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == b"named"
            st = procfs.read_stat(child.pid)
            assert st is not None and st.ppid == os.getpid()
            assert child.pid in {s.pid for s in procfs.all_stats()}
        finally:
            child.kill()
