"""Bounded capture of a command's output, and its cleaning into text an agent can read.

A command may print 50 MB, or print forever without a newline. `OutputBuffer` keeps the head and the tail
of what it is fed, in bounded memory, and counts what it dropped in between; `clean_text` turns the kept
bytes into text (terminal escape sequences removed, invalid UTF-8 replaced).
"""

from __future__ import annotations

import re

# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ESC \), other two-byte ESC sequences, and 8-bit C1 CSI.
# Bracketed-paste toggles (ESC [?2004h) are CSI sequences and go with them.
_ESCAPES = re.compile(
    rb"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI
    rb"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC, terminated by BEL or ST
    rb"|\x1b[PX^_][^\x1b]*\x1b\\"  # DCS, SOS, PM, APC strings
    rb"|\x1b[ -/]*[0-~]"  # other escapes: ESC =, ESC M, ESC 7, charset selection ESC ( B
    rb"|\x9b[0-?]*[ -/]*[@-~]"  # C1 CSI
)


def clean_text(data: bytes) -> str:
    """Decode terminal output for an agent: escape sequences stripped, invalid UTF-8 replaced."""
    return _ESCAPES.sub(b"", data).decode("utf-8", errors="replace")


class OutputBuffer:
    """Keeps the first and the last `limit // 2` bytes of a stream, counting what falls in between.

    Memory stays O(limit) whatever the stream's length: the tail is trimmed whenever it grows past twice
    its share, so trimming costs amortised O(1) per byte.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._head_cap = limit - limit // 2
        self._tail_cap = limit // 2
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data and self._tail_cap:
            self._tail += data
            if len(self._tail) > 2 * self._tail_cap:
                del self._tail[: len(self._tail) - self._tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def take(self) -> tuple[str, bool]:
        """Return (text, truncated) for everything fed so far, and empty the buffer."""
        tail = self._tail[-self._tail_cap :] if self._tail_cap else b""
        kept = len(self._head) + len(tail)
        if self.total > kept:
            notice = f"\n[... {self.total - kept} bytes of output omitted ...]\n"
            text = clean_text(bytes(self._head)) + notice + clean_text(bytes(tail))
        else:
            text = clean_text(bytes(self._head) + bytes(tail))
        truncated = self.total > kept
        self._head.clear()
        self._tail.clear()
        self.total = 0
        return text, truncated
