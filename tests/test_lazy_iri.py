"""The command line defers `rfc3987_syntax`'s grammar build, and IRI checks answer as before
(jupyter_lmsp/lazy_iri.py). Each check runs in a fresh interpreter: this one has long imported
jsonschema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

IRIS = ["http://example.com/\u00fcber", "urn:isbn:0451450523", "http://exa mple.com", "::"]

CHECK = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "deferred":
        import jupyter_lmsp.cli  # registers the stand-in, then imports Jupyter Server
        assert "rfc3987_syntax.syntax_helpers" not in sys.modules, "the grammar was built"
    from jsonschema import Draft202012Validator
    checker = Draft202012Validator.FORMAT_CHECKER
    assert "iri" in checker.checkers, "jsonschema checks IRIs with rfc3987_syntax"
    answers = {
        iri: [checker.conforms(iri, "iri"), checker.conforms(iri, "iri-reference")]
        for iri in json.loads(sys.argv[2])
    }
    real = "rfc3987_syntax.syntax_helpers" in sys.modules
    print(json.dumps({"answers": answers, "real_module_loaded": real}))
    """
)


def check(how: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHECK, how, json.dumps(IRIS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_iri_checks_answer_the_same_with_the_grammar_deferred() -> None:
    eager, deferred = check("eager"), check("deferred")
    assert deferred["answers"] == eager["answers"]
    # The cases tell valid from invalid, so equal answers mean something.
    assert eager["answers"]["http://example.com/\u00fcber"] == [True, True]
    assert eager["answers"]["http://exa mple.com"] == [False, False]
    # The first check imported the real module.
    assert deferred["real_module_loaded"] and eager["real_module_loaded"]


PROBE_APP = textwrap.dedent(
    """
    import json, sys
    import jupyter_server.serverapp  # what `python -m jupyter_server` imports first
    print(json.dumps({
        "name": __name__,
        "argv": sys.argv[1:],
        "grammar_built": "rfc3987_syntax.syntax_helpers" in sys.modules,
    }))
    """
)


def test_servers_launched_through_the_sandbox_defer_the_grammar(tmp_path) -> None:
    """`python -m jupyter_lmsp.launch APP ARGS` runs APP as `python -m APP ARGS` does, with the
    stand-in registered first (the sandbox starts every test and benchmark server so)."""
    (tmp_path / "probe_app.py").write_text(PROBE_APP)
    result = subprocess.run(
        [sys.executable, "-m", "jupyter_lmsp.launch", "probe_app", "--port=1", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"name": "__main__", "argv": ["--port=1", "x"], "grammar_built": False}
    # Without it the same import builds the grammar (so the assertion above can fail).
    plain = subprocess.run(
        [sys.executable, "-m", "probe_app"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert json.loads(plain.stdout)["grammar_built"] is True, plain.stderr
