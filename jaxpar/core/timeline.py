"""Start-up milestones of a process, for `benchmarks/restart.py`: where the seconds to a first step go.

With JAXPAR_TIMELINE=FILE set, `mark(event)` appends one JSON line (event, wall time, pid, rank) to FILE; unset, it
does nothing. Lines are short single writes in append mode, so several processes may share one file.
"""

from __future__ import annotations

import json
import os
import time

ENV = "JAXPAR_TIMELINE"


def mark(event: str) -> None:
    """Record that this process reached `event` now (a no-op without JAXPAR_TIMELINE)."""
    path = os.environ.get(ENV)
    if path:
        line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(),
                           "rank": os.environ.get("JAX_PROCESS_ID")})
        with open(path, "a") as file:
            file.write(line + "\n")
