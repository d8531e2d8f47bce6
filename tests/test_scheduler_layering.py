"""The scheduler is pure Python: importing it (and everything it re-exports) must not
pull in torch or ray. Checked in a fresh interpreter, since this test process may
already have imported them for other tests."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_scheduler_pulls_in_neither_torch_nor_ray():
    code = ("import scheduler, sys; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'triton')); "
            "assert not bad, bad; "
            "scheduler.Scheduler, scheduler.SchedulerOutput, scheduler.EngineCoreOutput")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
