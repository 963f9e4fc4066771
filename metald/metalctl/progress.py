"""Progress that ``--wait`` shows: redrawn in place on a terminal (the previous frame is
erased with ANSI cursor movement), plain lines elsewhere, and then only when it changed, so
a log or a pipe gets one line per change rather than one per poll."""

from __future__ import annotations

import sys
from typing import TextIO

#: ANSI: cursor up N lines to column 1 (CPL), then erase to the end of the screen (ED).
UP = "\x1b[{n}F"
ERASE = "\x1b[J"


class Progress:
    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.lines = 0
        self.last: str | None = None

    def show(self, frame: str) -> None:
        """Replace the previous frame (terminal) or print this one if it differs (else)."""
        frame = frame.rstrip("\n")
        if self.tty:
            if self.lines:
                self.stream.write(UP.format(n=self.lines) + ERASE)
            self.stream.write(frame + "\n")
            self.lines = frame.count("\n") + 1
        elif frame != self.last:
            self.stream.write(frame + "\n")
        self.last = frame
        self.stream.flush()
