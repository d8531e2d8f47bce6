"""Run a test module as a script under the Triton interpreter and collect its JSON lines.

TRITON_INTERPRET=1 must be in the environment when ``@triton.jit`` runs (when the kernel
modules are first imported), and pytest imports every test module into one process, so
interpreter cases run in a child process; it prints one ``{"case": ..., "result": ...}``
line per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def interpreter_results(script: str, timeout: int = 900) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[rec["case"]] = rec["result"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out
