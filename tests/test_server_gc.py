"""The server takes its start-up heap out of the garbage collector's scans (`gc.freeze`).

A Jupyter server starts with ~250k objects; while they were scanned, every full collection
stalled the event loop (each request, each event stream) for ~150 ms, and a burst of requests
that met one reached the worker split in two.
"""

from __future__ import annotations

import re
import time

import pytest
from serverproc import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FROZEN = re.compile(r"LMSP: (\d+) start-up objects frozen out of GC scans")


@pytest.mark.parametrize("freeze", [True, False])
def test_the_start_up_heap_is_frozen_out_of_gc_scans(lmsp_data, freeze):
    with ServerProcess(lmsp_data, freeze_startup_heap=freeze) as server, server.client() as c:
        assert c.get("/service").status_code == 200
        # Frozen on the loop's first turns, before /service could answer: waiting long is
        # only for the log line to reach the file.
        deadline = time.monotonic() + (10 if freeze else 2)
        found = None
        while found is None and time.monotonic() < deadline:
            found = FROZEN.search(server.log_path.read_text(errors="replace"))
            time.sleep(0.1)
    if freeze:
        assert found is not None, server.log_tail()
        # The server's own objects (Jupyter, Tornado, SQLAlchemy, ...), not a handful.
        assert int(found.group(1)) > 50_000
    else:
        assert found is None
