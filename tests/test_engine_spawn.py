"""A spawned worker does not run its parent's main script again (engine/spawn.py).

The parent here is a real script (as `jupyter server` is when a user starts it), which records
each time it is executed and under which name; the child is a real spawn-context process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from serverproc import ServerProcess
from test_worker_crash import worker_pid

PARENT = textwrap.dedent(
    """
    import multiprocessing
    import os
    import sys

    with open(os.environ["MARKS"], "a") as marks:
        marks.write(__name__ + "\\n")

    if __name__ == "__main__":
        from jupyter_lmsp.engine.spawn import main_reruns_in_child, start_without_main

        with open(os.environ["MARKS"], "a") as marks:
            marks.write(f"reruns={main_reruns_in_child()}\\n")
        main = sys.modules["__main__"]
        process = multiprocessing.get_context("spawn").Process(target=os.getpid)
        if sys.argv[1] == "plain":
            process.start()
        else:
            start_without_main(process)
        assert sys.modules["__main__"] is main, "the main module is put back"
        process.join(60)
        assert process.exitcode == 0, process.exitcode
    """
)


def run_parent(tmp_path: Path, how: str) -> list[str]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    marks = tmp_path / f"marks-{how}"
    subprocess.run(
        [sys.executable, str(script), how],
        check=True,
        env={"MARKS": str(marks), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    return marks.read_text().split()


def test_plain_spawn_runs_the_parent_script_again(tmp_path: Path) -> None:
    """The control: what multiprocessing does by itself, which start_without_main avoids."""
    assert run_parent(tmp_path, "plain") == ["__main__", "reruns=True", "__mp_main__"]


def test_start_without_main_does_not_run_the_parent_script_again(tmp_path: Path) -> None:
    assert run_parent(tmp_path, "without-main") == ["__main__", "reruns=True"]


@pytest.mark.parametrize("how", ["plain", "without-main"])
def test_a_module_run_with_dash_m_is_never_run_again(tmp_path: Path, how: str) -> None:
    """`python -m package` (as the tests start `jupyter_server`): nothing to hide."""
    package = tmp_path / "parentpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(PARENT)
    marks = tmp_path / f"marks-m-{how}"
    subprocess.run(
        [sys.executable, "-m", "parentpkg", how],
        check=True,
        cwd=tmp_path,
        env={"MARKS": str(marks), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert marks.read_text().split() == ["__main__", "reruns=False"]


class ScriptServer(ServerProcess):
    """The server as users start it: the `jupyter-server` console script, not `-m`."""

    def command(self) -> list[str]:
        args = super().command()
        assert args[1:4] == ["-m", "jupyter_lmsp.launch", "jupyter_server"], args
        return [str(Path(sys.executable).parent / "jupyter-server"), *args[4:]]


def mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if len(line.split()) >= 6}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
@pytest.mark.slow  # a server subprocess
def test_the_worker_of_a_script_started_server_does_not_import_jupyter_server(lmsp_data):
    """End to end: Tornado (which every Jupyter Server imports, and which maps its compiled
    `speedups` module) is absent from the worker of a console-script server that has answered."""
    with ScriptServer(lmsp_data) as server, server.client() as c:
        r = c.post("/responses", json={"input": "Hello", "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] == 4, r.json()  # the worker generated
        pid = worker_pid(c)
        assert any("/tornado/" in path for path in mapped_files(server.proc.pid))
        assert not any("/tornado/" in path for path in mapped_files(pid))
