"""How the user runs this client again, as they can type it here: every hint the CLI prints names the interpreter
that runs it (`.venv/bin/python -m client ...` from the checkout, no activated venv needed), never a bare `python`
that may be another interpreter or none at all."""

from __future__ import annotations

import os
import sys


def self_command() -> str:
    """`<interpreter> -m client`: the interpreter relative to the working directory when it lies below it
    (`.venv/bin/python`), else its full path."""
    exe = os.path.abspath(sys.executable)
    rel = os.path.relpath(exe)
    return f"{rel if not rel.startswith('..') else exe} -m client"
