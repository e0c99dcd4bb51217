"""The server's command pipe to the engine process: never blocks the event loop, frames as Connection."""

import asyncio
import threading

from engine.server.command_pipe import CommandPipe


async def test_a_command_larger_than_the_pipe_goes_out_without_blocking_the_loop():
    pipe = CommandPipe(asyncio.get_running_loop())
    big = ("add", list(range(300_000)))  # ~1.5 MB pickled: many times a pipe's buffer
    pipe.send(big)  # nobody reads yet: a blocking write would hang here
    pipe.send("after")
    received = []
    reader = threading.Thread(target=lambda: received.extend(pipe.reader.recv() for _ in range(2)))
    reader.start()
    while reader.is_alive():  # the loop keeps turning; the rest is written as the pipe drains
        await asyncio.sleep(0.005)
    assert received == [big, "after"]
    pipe.close()


async def test_a_gone_reader_makes_sends_harmless():
    pipe = CommandPipe(asyncio.get_running_loop())
    pipe.reader.close()
    pipe.send("first")  # EPIPE: the engine process is gone (its report pipe tells the server)
    assert pipe.broken
    pipe.send("dropped")
    pipe.close()
    pipe.close()  # twice: harmless
    pipe.send("after close")  # dropped, never written to a file descriptor number reused since
