"""File handles for connections: the process's open-file limit raised as far as the connection caps need
(up to the hard limit), and the caps lowered, with one warning, where even that is too little.

    max_connections = fit_connections(settings.max_connections, fronts=2)

Every connection is a file handle. A process that runs out cannot accept, which asyncio reports on
every attempt, and cannot answer `/health` either; the caps are there to stop short of that.
"""

from __future__ import annotations

import logging
import resource

from service.fronts.http.connections import RESERVE
from service.fronts.http.listener import BACKLOG

log = logging.getLogger("attnserve.server")

OTHER_HANDLES = 256  # the model's files, threads, the metrics port, logs, and the connections being accepted


def handles_needed(max_connections: int, fronts: int) -> int:
    return fronts * max_connections + RESERVE + BACKLOG + OTHER_HANDLES


def fit_connections(max_connections: int, fronts: int) -> int:
    """`max_connections`, or as many as the open-file limit allows each front, after raising the soft limit."""
    need = handles_needed(max_connections, fronts)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    fitted = max(1, (soft - RESERVE - BACKLOG - OTHER_HANDLES) // fronts)
    log.warning("the open-file limit is %d (hard limit %s): max_connections lowered from %d to %d per front; "
                "raise it (ulimit -n, docker run --ulimit nofile=%d) to serve more", soft, hard, max_connections,
                fitted, need)
    return fitted
