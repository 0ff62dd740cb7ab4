"""Where a collective was called from: the caller's line, as a code the ranks compare.

Each rank counts its own calls, so a rank that skips one call in a sequence of
same-shaped collectives still sends call numbers that match the others', and
the argument check would pair two different calls. The line that made the call
tells them apart: ``site_code`` is a CRC-32 of ``file:line`` of the first frame
outside the mpiring package (the user's line, also when DDP or ZeRO make the
call for it), and the argument check compares it across ranks.

Only the file's base name enters the code: ranks may run the same script from
different directories. Two calls from the same line (a loop) have the same
code; there the call number tells a rank that made more calls from the others.

A call through the torch.distributed drop-in (``mpiring.comm.functional``) has
code 0, compared as equal everywhere: torch lets ranks make one collective from
different lines (``if rank == 0: dist.broadcast(x, 0) else: dist.broadcast(y, 0)``),
and a ported script must run as it did; its call numbers are still compared.
"""

from __future__ import annotations

import os
import sys
import zlib

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DROPIN = os.path.join(_PACKAGE, "comm", "functional.py")
_inside: dict[str, bool] = {}  # file name -> whether it is part of mpiring
_codes: dict[tuple[str, int], int] = {}  # (file, line) -> code
_names: dict[int, str] = {}  # code -> "file:line", to print a code back
_REMEMBER = 4096  # a program has a few hundred call sites; a pathological one stops adding


def site_code(depth: int = 1) -> int:
    """The code of the first caller outside mpiring, ``depth`` frames above the caller."""
    frame = sys._getframe(depth + 1)
    while frame is not None:
        filename = frame.f_code.co_filename
        inside = _inside.get(filename)
        if inside is None:
            inside = _inside[filename] = filename.startswith(_PACKAGE)
        if not inside:
            break
        if filename == _DROPIN:  # torch's API: any line may make the call (see above)
            return 0
        frame = frame.f_back
    if frame is None:  # called from mpiring itself, at the top of a thread
        return 0
    key = (filename, frame.f_lineno)
    code = _codes.get(key)
    if code is None:
        name = f"{os.path.basename(filename)}:{frame.f_lineno}"
        code = zlib.crc32(name.encode()) & 0x7FFFFFFF
        if len(_codes) < _REMEMBER:
            _codes[key] = code
            _names[code] = name
    return code


def site_name(code: int) -> str:
    """``file:line`` for a code this process made, else the code in hex."""
    if code == 0:
        return "inside mpiring"
    return _names.get(code, f"site {code:08x}")
