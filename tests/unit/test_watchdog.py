"""The watchdog never frees the communicator its thread may still be using."""

import threading
import time

from syncdp.core import mpi, settings
from syncdp.core.watchdog import Watchdog


def test_stop_waits_for_a_busy_thread_before_freeing_its_communicator():
    MPI = mpi.load()
    dog = Watchdog(MPI.COMM_SELF, settings.from_env({}))
    busy, seen = threading.Event(), []

    def slow_answer():  # the thread, in the middle of talking to the other ranks
        busy.set()
        time.sleep(3)  # longer than the 2 s the old stop() waited
        seen.append(dog._side is not None and dog._side != MPI.COMM_NULL)

    dog._can_ask = True
    dog._answer_questions = slow_answer
    assert busy.wait(5)
    dog.stop()
    assert not dog._thread.is_alive()
    assert seen == [True], "the communicator was freed while the thread still used it"
    assert dog._side is None
