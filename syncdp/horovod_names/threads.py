"""``horovod.runner.util.threads``: the two thread helpers Horovod's test utilities import."""

from __future__ import annotations

import threading

__all__ = ["in_thread", "on_event"]


def in_thread(target, args=(), name=None, daemon=True, silent=False) -> threading.Thread:
    """Runs ``target(*args)`` in a new thread (a daemon by default) and returns the thread.

    Args:
        target: The function.
        args: Its arguments, a tuple (or one value). Defaults to ().
        name: The thread's name. Defaults to Python's.
        daemon: Whether the thread is a daemon. Defaults to True.
        silent: Swallow an exception of ``target`` instead of letting it print. Defaults to False.
    """
    if not isinstance(args, tuple):
        args = (args,)

    def run():
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event, func, args=(), stop=None, check_interval_seconds=1.0, silent=False):
    """Calls ``func(*args)`` in a daemon thread once ``event`` is set; returns the thread.

    Args:
        event: A ``threading.Event``.
        func: What to call.
        args: Its arguments. Defaults to ().
        stop: An event that, once set first, ends the wait without calling ``func``.
        check_interval_seconds: How often ``stop`` is looked at. Defaults to 1.0.
        silent: As for :func:`in_thread`. Defaults to False.
    """
    if not isinstance(args, tuple):
        args = (args,)

    def wait_then_call():
        while not event.wait(check_interval_seconds):
            if stop is not None and stop.is_set():
                return
        func(*args)

    return in_thread(wait_then_call, silent=silent)
