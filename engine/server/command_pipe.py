"""The server's commands to the engine process, written by the event loop without ever blocking it.

A command goes out the moment it is sent: no thread in between, which would have to win the GIL from
a busy event loop first (Python hands it over every 5 ms), costing a burst of 32 requests ~0.1 s
before the engine saw the last of them. A large prompt meeting a full pipe is not written in one go:
the rest waits in a buffer until the pipe is writable again, while the loop serves everyone else.
The engine process reads the pipe as a multiprocessing Connection (`recv()`), so each command is
framed as Connection.send frames it: a 4-byte big-endian length (-1 then 8 bytes past 2 GiB), then
the pickle.
"""

import asyncio
import os
import struct
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any


class CommandPipe:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        """Commands are sent from `loop`'s thread; it writes what a full pipe did not take."""
        read_fd, self._fd = os.pipe()
        self.reader = Connection(read_fd, writable=False)  # for the engine process; close it here once it started
        os.set_blocking(self._fd, False)
        self._loop = loop
        self._pending: deque[memoryview] = deque()
        self._watching = False
        self.broken = False  # the engine process is gone (or the pipe closed): what is sent is dropped

    def send(self, command: Any) -> None:
        """Write a command now, as far as the pipe takes it; the rest follows when it is writable."""
        if self.broken:
            return
        data = ForkingPickler.dumps(command)
        n = len(data)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        self._pending.extend((memoryview(header), memoryview(data)))
        if len(self._pending) == 2:  # nothing was waiting: write at once
            self._flush()

    def _flush(self) -> None:
        try:
            while self._pending:
                head = self._pending[0]
                written = os.write(self._fd, head)
                if written < len(head):
                    self._pending[0] = head[written:]
                    break
                self._pending.popleft()
        except BlockingIOError:
            pass
        except (BrokenPipeError, OSError):  # the engine process exited; its report pipe says so
            self.broken = True
            self._pending.clear()
        self._watch(bool(self._pending))

    def _watch(self, on: bool) -> None:
        if on and not self._watching:
            self._loop.add_writer(self._fd, self._flush)
        elif not on and self._watching:
            self._loop.remove_writer(self._fd)
        self._watching = on

    def close(self) -> None:
        if self._fd < 0:  # closed already
            return
        self._watch(False)
        self._pending.clear()
        self.broken = True
        os.close(self._fd)
        self._fd = -1
