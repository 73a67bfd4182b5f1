"""The Jupyter server token `make serve` keeps, so clients work across restarts.

Jupyter Server makes up a new token at every start unless one is given (`JUPYTER_TOKEN`, or
`c.IdentityProvider.token` in a config file). `make serve` gives it the token kept in the
file `server-token` of the LMSP data folder (`{jupyter data dir}/lmsp` by default), made once
with 32 random bytes and readable by its owner only (0600, in a 0700 folder):

    python -m jupyter_lmsp.auth.servertoken [--data-dir DIR] [--new]

prints that token, creating the file when missing (`--new` replaces it: every client then
needs the new one). A script or SDK client reads the same file, or is given the printed token
once; `JUPYTER_TOKEN=$(python -m jupyter_lmsp.auth.servertoken) jupyter lab` starts any other
Jupyter application with it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

TOKEN_FILE = "server-token"


def default_data_dir() -> Path:
    """`{jupyter data dir}/lmsp`, the extension's default `data_dir`."""
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "lmsp"


def token_path(data_dir: Path | None = None) -> Path:
    return (data_dir if data_dir is not None else default_data_dir()) / TOKEN_FILE


def kept_token(data_dir: Path | None = None, *, new: bool = False) -> str:
    """The kept token of `data_dir`, made (0600) when there is none or `new` is set."""
    path = token_path(data_dir)
    if not new:
        try:
            token = path.read_text().strip()
        except FileNotFoundError:
            token = ""
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    # Written beside and renamed over: a reader never sees half a token, nor a wider mode.
    partial = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    os.replace(partial, path)
    return token


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jupyter_lmsp.auth.servertoken",
        description="Print the Jupyter server token kept in the LMSP data folder (made once).",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="the LMSP data folder (default: <jupyter data dir>/lmsp)",
    )
    parser.add_argument("--new", action="store_true", help="replace the kept token with a new one")
    parser.add_argument(
        "--path", action="store_true", help="print the token file's path instead of the token"
    )
    args = parser.parse_args(argv)
    token = kept_token(args.data_dir, new=args.new)
    print(token_path(args.data_dir) if args.path else token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
