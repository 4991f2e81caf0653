"""Orbax's echoes of a failure jaxpar already reports, kept off the screen."""

from __future__ import annotations

import functools
import logging
import sys
import types


def _orbax_echo(error: BaseException | None, origin: object = None) -> bool:
    """Whether an error reported after the fact is the echo of a failed Orbax read (see `quiet_orbax`)."""
    if isinstance(origin, types.CoroutineType):
        return "orbax" in origin.cr_code.co_filename
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    if error is not None and "OCDBT database" in str(error):  # TensorStore's read of a damaged file, from a task
        return True  # asyncio wrapped (its traceback holds asyncio's frames only)
    frames = error.__traceback__ if error is not None else None
    while frames is not None:
        if "orbax" in frames.tb_frame.f_code.co_filename:
            return True
        frames = frames.tb_next
    return False


@functools.cache
def quiet_orbax() -> None:
    """Keep Orbax's echoes of what jaxpar already reports off the screen (installed once per process).

    When one array of a damaged checkpoint fails to read, Orbax closes its event
    loop while TensorStore still finishes the other reads. Those then report
    "Event loop is closed", a never-awaited coroutine or a never-retrieved task
    error, from other threads and as late as interpreter exit, after the failure
    was raised as one CorruptCheckpoint. And every read-only open warns that the
    directory is read-only, which is what the caller asked for.
    """
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _orbax_echo(unraisable.exc_value, unraisable.object):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(lambda record: not (record.exc_info and _orbax_echo(record.exc_info[1])))
    logging.getLogger("absl").addFilter(lambda record: not str(record.msg).startswith("Given directory is read only"))
