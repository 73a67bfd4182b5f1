"""The server's log, without the cost of the debug messages nobody reads.

traitlets sets an application's logger to DEBUG and leaves the filtering to its handlers (at
`log_level`, INFO unless asked). Jupyter Server logs every successful request, and the token
check of every request, at debug level: each builds a log record the handler then drops, about
0.1 ms of the loop's time per request (a py-spy profile of background creates: 5% of the
server's CPU). The logger is set to the lowest level its handlers take, which drops nothing any
handler would have written; `--log-level=DEBUG` still logs them (its handler takes DEBUG).
"""

from __future__ import annotations

import logging


def quiet_debug(log: logging.Logger | logging.LoggerAdapter[logging.Logger]) -> None:
    """Raise `log`'s level to the lowest of its handlers' (none: left as it is)."""
    logger = log.logger if isinstance(log, logging.LoggerAdapter) else log
    levels = [handler.level for handler in logger.handlers]
    if levels and logger.level < min(levels):
        logger.setLevel(min(levels))
