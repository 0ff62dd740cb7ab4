"""Reading ``MPIRING_*`` switches the same way wherever they are read.

``mpiring.init`` checks every variable on every rank before anything starts
(comm/start.py); the readers here are what a Communicator, the page allocator
and the others use, with or without ``init``, so a value ``init`` would refuse
is refused here too rather than read as something else.
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """``name`` as a flag (1/true/yes/on, 0/false/no/off; unset or empty: ``default``).

    Raises:
        ValueError: any other value, naming the values that work.
    """
    raw = os.environ.get(name, "")
    text = raw.strip().lower()
    if text == "":
        return default
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise ValueError(f"{name}={raw!r}: use 1 or 0 (true/false, yes/no, on/off)")


def env_switch(name: str, fix: str) -> bool:
    """``name`` as 1 or 0 only (unset or empty: on), for the switches that take no other word.

    Raises:
        ValueError: any other value; ``fix`` says what to set.
    """
    raw = os.environ.get(name, "")
    text = raw.strip()
    if text in ("", "1", "0"):
        return text != "0"
    raise ValueError(f"{name}={raw!r}: {fix}")
