"""`jupyter lmsp ...` run in the test's own process (fast, and its output in `capsys`).

The command classes are traitlets application singletons: a second command in one process would
find the first's instance, so every one is cleared after each run."""

from __future__ import annotations

from jupyter_lmsp import cli


def _commands(cls: type[cli.Command]) -> list[type[cli.Command]]:
    found = [cls]
    for sub in cls.__subclasses__():
        found += _commands(sub)
    return found


def run_cli(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    finally:
        for command in _commands(cli.Command):
            command.clear_instance()
