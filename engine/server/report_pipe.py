"""The engine process's reports to the server: framed pickles on a pipe, held back while the server is behind.

The engine writes one message per pass of its loop; at one stream that is one per token, so what a
message costs is paid per token on the engine's critical path. Each message is a 4-byte big-endian
length, then a pickle (Connection.send's framing): a batch of reports is a list of plain tuples
(`Report.pack()`), pickled in ~2 us where a dataclass through ForkingPickler took ~8-18 us.
While the server has not yet read the last message (bytes still sit in the pipe), the engine does not
write: it keeps its reports and sends them together at the first pass that finds the pipe drained, so
a busy event loop gets several steps per message, and a full pipe never blocks the engine. The server
reads whatever the pipe holds in one non-blocking read per wake-up and cuts it into messages.
"""

import array
import fcntl
import os
import pickle
import struct
import termios
from multiprocessing.connection import Connection
from typing import Any

_HEADER = struct.Struct("!i")
_READ_SIZE = 1 << 20


class ReportWriter:
    """Engine process side."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn  # kept: it owns the descriptor
        self._fd = conn.fileno()
        self._held: list[tuple] = []  # packed reports not written yet
        self._unread = array.array("i", [0])
        self.num_writes = 0

    def add(self, packed_report: tuple) -> None:
        self._held.append(packed_report)

    def flush(self, force: bool = False) -> None:
        """Write the held reports as one message, unless the server has yet to read the last (then they wait
        for the next pass; `force`: write anyway, e.g. before the engine sleeps)."""
        if not self._held:
            return
        if not force:
            fcntl.ioctl(self._fd, termios.FIONREAD, self._unread, True)
            if self._unread[0]:
                return
        held, self._held = self._held, []
        self._write(pickle.dumps(held, pickle.HIGHEST_PROTOCOL))

    def send(self, message: Any) -> None:
        """A message other than reports (Ready, Failed): after the held reports, at once."""
        self.flush(force=True)
        self._write(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def _write(self, data: bytes) -> None:
        view = memoryview(_HEADER.pack(len(data)) + data)
        while view:  # the pipe is blocking here: a message larger than its buffer goes in parts
            view = view[os.write(self._fd, view):]
        self.num_writes += 1


class ReportReader:
    """Server side (the event loop): non-blocking reads, whole messages out."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._buffer = bytearray()

    def fileno(self) -> int:
        return self._fd

    def read(self) -> tuple[list[Any], bool]:
        """-> (the messages the pipe held, whether the engine's end has closed)."""
        closed = False
        while True:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                break
            if not data:
                closed = True
                break
            self._buffer += data
            if len(data) < _READ_SIZE:
                break
        messages, buffer, start = [], self._buffer, 0
        with memoryview(buffer) as view:  # released before the buffer is cut
            while len(buffer) - start >= 4:
                (size,) = _HEADER.unpack_from(buffer, start)
                if len(buffer) - start - 4 < size:
                    break
                messages.append(pickle.loads(view[start + 4 : start + 4 + size]))
                start += 4 + size
        del buffer[:start]
        return messages, closed

    def close(self) -> None:
        self._conn.close()
