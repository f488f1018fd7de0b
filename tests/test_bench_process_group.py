"""The vLLM benchmark's child runs in a process group of its own, which goes with the parent:
a benchmark stopped by `timeout` leaves no engine process holding GPU memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# A child that starts a grandchild (as vLLM's engine core is started), writes its pid, sleeps.
CHILD = textwrap.dedent("""
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(sys.argv[1], "w").write(str(grandchild.pid))
    time.sleep(120)
""")
# The benchmark's parent: SIGTERM and SIGHUP handled as its main does, the child in its
# process group; Ctrl-C raising KeyboardInterrupt, as in a foreground shell (a shell that runs
# the tests in the background has its children ignore SIGINT).
PARENT = textwrap.dedent("""
    import signal, sys
    from sparse_core.bench.vllm_plugin import exit_on_termination, run_process_group
    signal.signal(signal.SIGINT, signal.default_int_handler)
    exit_on_termination()
    run_process_group([sys.executable, "-c", sys.argv[1], sys.argv[2]], None)
""")


def alive(pid: int) -> bool:
    """Running: a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_stopping_the_benchmark_stops_its_child_and_grandchild(tmp_path, signum):
    pid_file = tmp_path / "grandchild.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(pid_file)])
    grandchild = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the grandchild never started"
            assert parent.poll() is None, "the parent exited early"
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        assert alive(grandchild)
        parent.send_signal(signum)
        assert parent.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while alive(grandchild):
            assert time.monotonic() < deadline, "the grandchild outlived the stopped benchmark"
            time.sleep(0.05)
    finally:
        parent.kill()
        if grandchild is not None and alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
