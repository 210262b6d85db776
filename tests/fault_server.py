"""`python -m specserve.server` with faults injected into the engine step, for the isolation
tests (set as SPECSERVE_TEST_SERVER_ENTRY). A request whose prompt holds one of these markers
makes every step it is scheduled in:

  FAULT-RAISE  raise RuntimeError (a bug in the step: the engine traces it to this request);
  FAULT-STALL  sleep FAULT_STALL_SECONDS once (a step that hangs: /health must say so);
  FAULT-KILL   raise SystemExit (the engine thread dies: the process must exit non-zero).

Everything else is the real server and the real model.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.engine import Engine  # noqa: E402

STALL_SECONDS = float(os.environ.get("FAULT_STALL_SECONDS", "4"))
_real_run = Engine._run
_stalled: set[str] = set()


def _run(self, sched, *args, **kwargs):
    for req in sched.requests:
        prompt = req.prompt or ""
        if "FAULT-RAISE" in prompt:
            raise RuntimeError(f"injected fault (secret detail of {req.request_id})")
        if "FAULT-KILL" in prompt:
            raise SystemExit("injected: the engine thread dies")
        if "FAULT-STALL" in prompt and req.request_id not in _stalled:
            _stalled.add(req.request_id)
            time.sleep(STALL_SECONDS)
    return _real_run(self, sched, *args, **kwargs)


Engine._run = _run

if __name__ == "__main__":
    from specserve.server.cli import main

    sys.exit(main())
