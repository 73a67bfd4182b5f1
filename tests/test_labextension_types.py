"""The sidebar's TypeScript types are the OpenAPI document's: `labextension/openapi.json` is the
document jupyter_lmsp's models and routes make now, and `labextension/src/generated/lmsp.ts` is
what openapi-typescript (the build step `jlpm build:types`) makes of it. Either drifting
(a model changed without `make types`) fails here."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from prerequisites import require

from jupyter_lmsp import __version__
from jupyter_lmsp.handlers.openapi import document

LABEXT = Path(__file__).resolve().parent.parent / "labextension"
COMMITTED_DOCUMENT = LABEXT / "openapi.json"
COMMITTED_TYPES = LABEXT / "src" / "generated" / "lmsp.ts"
GENERATOR = LABEXT / "node_modules" / ".bin" / "openapi-typescript"


def test_the_committed_document_is_the_current_one():
    current = document("/lmsp/v1", __version__)
    assert json.loads(COMMITTED_DOCUMENT.read_text()) == current, (
        "labextension/openapi.json is stale: run `make types` and commit the result"
    )


def test_the_committed_types_are_generated_from_the_document(tmp_path):
    require(GENERATOR.exists(), "the labextension's node_modules (`make labextension`)")
    package = json.loads((LABEXT / "package.json").read_text())
    # The build step itself, as package.json runs it, into a scratch file.
    command = package["scripts"]["build:types"].split()
    assert command[0] == "openapi-typescript"
    output = command.index("--output") + 1
    command[output] = str(tmp_path / "lmsp.ts")
    subprocess.run(
        [str(GENERATOR), *command[1:]], cwd=LABEXT, check=True, capture_output=True, timeout=120
    )
    assert (tmp_path / "lmsp.ts").read_text() == COMMITTED_TYPES.read_text(), (
        "labextension/src/generated/lmsp.ts differs from openapi-typescript's output: run "
        "`make types` and commit the result"
    )
