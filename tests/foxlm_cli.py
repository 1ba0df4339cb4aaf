"""Running the ``foxlm`` command line as a user does: a child process, its exit status and its two streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def foxlm(*args: str, cwd=None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``foxlm ARGS`` in a child process (this checkout's code, the PyTorch attention path, one thread)."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FOXLM_DEBUG")}
    child_env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "foxlm.cli", *map(str, args)], cwd=cwd, env=child_env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, command: str) -> str:
    """The message of a user error: exit status 2 and a single ``foxlm COMMAND: error: ...`` line on stderr."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and lines[-1].startswith(f"foxlm {command}: error: "), proc.stderr
    return lines[-1]


def ctrl_c_reaches_it() -> None:
    """``Popen(preexec_fn=...)`` for a child that a test stops with SIGINT: Ctrl-C's default action, as a terminal's
    foreground job has it. A shell's background job starts with SIGINT ignored (nohup, ``cmd &`` in a script: how CI
    may run the tests), and a child inherits that, so it would finish its work instead."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
