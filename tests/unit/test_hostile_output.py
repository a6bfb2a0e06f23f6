"""The launcher's output: one rank's lines never run into another's, it is always text, and
Open MPI's banners that repeat the verdict take one line (the jobs are in
tests/integration/test_hostile_output.py)."""

from __future__ import annotations

import io

from syncdp.launch import output, worker

ABORT_BANNER = (
    b"--------------------------------------------------------------------------\n"
    b"MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n"
    b"  Proc: [[25580,1],0]\n"
    b"  Errorcode: 1\n"
    b"\n"
    b"NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.\n"
    b"You may or may not see output from other processes, depending on\n"
    b"exactly when Open MPI kills them.\n"
    b"--------------------------------------------------------------------------\n"
)
EXITED_BANNER = (
    b"--------------------------------------------------------------------------\n"
    b"prterun has exited due to process rank 0 with PID 0 on node vm calling\n"
    b'"abort". This may have caused other processes in the application to be\n'
    b"terminated by signals sent by prterun (as reported here).\n"
    b"--------------------------------------------------------------------------\n"
)
ADVICE_BANNER = (
    b"--------------------------------------------------------------------------\n"
    b"It appears as if there is not enough space for /dev/shm/osc_sm.vm.1 (the\n"
    b"shared-memory backing file).\n"
    b"--------------------------------------------------------------------------\n"
)


def _supervised(rank: int, text: bytes, stream: str = "stdout") -> bytes:
    sink = io.BytesIO()
    worker._pump(io.BytesIO(text), sink, f"[{rank}]<{stream}>:".encode())
    return sink.getvalue()


def _launcher(sent: bytes, files=None, **kwargs) -> bytes:
    sink = io.BytesIO()
    output._pump(io.BytesIO(sent), sink, timestamps=False, files=files, **kwargs)
    return sink.getvalue()


def test_an_unterminated_last_line_stays_with_its_rank(tmp_path):
    one = _supervised(1, b"first\npartial line from rank 1")
    zero = _supervised(0, b"partial line from rank 0")
    files = output.RankFiles(str(tmp_path), 2)
    shown = _launcher(one + zero, files)
    files.close()
    assert shown.splitlines() == [
        b"[1]<stdout>:first",
        b"[1]<stdout>:partial line from rank 1",
        b"[0]<stdout>:partial line from rank 0",
    ]
    # The files hold what the ranks wrote: no newline after their last words.
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b"partial line from rank 0"
    assert (tmp_path / "rank.1" / "stdout").read_bytes() == b"first\npartial line from rank 1"


def test_a_restarted_jobs_first_line_does_not_join_the_last_runtimes_unterminated_one(tmp_path):
    # Keras' progress bar ends in "\r...", no newline, until the epoch ends: after a host-loss
    # restart the same rank's file takes the new runtime's lines on a line of their own.
    files = output.RankFiles(str(tmp_path), 1)
    _launcher(_supervised(0, b"epoch 1\n\r 10/100 loss: 0.5"), files)
    files.end_open_lines()
    _launcher(_supervised(0, b"resumed\n"), files)
    files.end_open_lines()  # nothing open: nothing added
    files.close()
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == (
        b"epoch 1\n\r 10/100 loss: 0.5\nresumed\n"
    )


def test_an_unterminated_line_over_a_piece_is_joined_whole_among_other_ranks(tmp_path):
    long_tail = b"x" * (output.PIECE_BYTES + 123)  # two pieces, the last unterminated
    one = _supervised(1, long_tail).splitlines(keepends=True)
    assert len(one) == 2 and all(line.endswith(b"\n") for line in one)
    zero = _supervised(0, b"partial line from rank 0")
    files = output.RankFiles(str(tmp_path), 2)
    shown = _launcher(one[0] + zero + one[1], files)
    files.close()
    assert shown.splitlines() == [
        b"[0]<stdout>:partial line from rank 0",
        b"[1]<stdout>:" + long_tail,
    ]
    assert (tmp_path / "rank.1" / "stdout").read_bytes() == long_tail


def test_the_console_gets_text_whatever_mpirun_sends(tmp_path):
    rank_line = _supervised(0, b"caf\xe9 \x00 \xff\xfe end\n")
    sent = ABORT_BANNER[:-1] + b"\n\x00" + b"syncdp-run: rank 0 exited with code 1.\n" + rank_line
    files = output.RankFiles(str(tmp_path), 1)
    shown = _launcher(sent, files, full_banners=True)
    files.close()
    assert b"\x00" not in shown
    text = shown.decode()  # strict: fails on any byte that is not UTF-8
    assert "syncdp-run: rank 0 exited with code 1.\n" in text.splitlines(keepends=True)
    assert "[0]<stdout>:caf\ufffd  \ufffd\ufffd end\n" in text
    # The rank's own file holds what it wrote.
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b"caf\xe9 \x00 \xff\xfe end\n"


def test_banners_that_repeat_the_verdict_take_one_line_each():
    shown = _launcher(ABORT_BANNER + b"[1]<stderr>:late\n" + EXITED_BANNER).decode()
    assert shown.splitlines() == [
        "syncdp-run: Open MPI: MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD "
        "(in full at --log-level DEBUG)",
        "[1]<stderr>:late",
        "syncdp-run: Open MPI: prterun has exited due to process rank 0 with PID 0 on node vm "
        'calling "abort". (in full at --log-level DEBUG)',
    ]


def test_full_banners_and_other_banners_pass_unchanged():
    assert _launcher(ABORT_BANNER + EXITED_BANNER, full_banners=True) == (
        ABORT_BANNER + EXITED_BANNER
    )
    assert _launcher(ADVICE_BANNER) == ADVICE_BANNER
    # A banner cut off by the end of the stream, or one too long to be a banner, is kept.
    assert _launcher(ABORT_BANNER[:-75]) == ABORT_BANNER[:-75]  # no closing rule
    rules = b"-" * 74 + b"\n"
    long_block = rules + b"MPI_ABORT was invoked on rank 0\n" * 60 + rules
    assert _launcher(long_block) == long_block


UNTESTED_BANNER = (
    b"--------------------------------------------------------------------------\n"
    b"WARNING: The selected 'osc' module 'sm' is not tested for post-failure\n"
    b"operation, yet you have requested support for fault tolerance.\n"
    b"When using this component, normal failure free operation is expected;\n"
    b"However, failures may cause the application to abort, crash or deadlock.\n"
    b"\n"
    b"In this framework, the following components are tested to operate under\n"
    b"failure scenarios: {}\n"
    b"--------------------------------------------------------------------------\n"
)
# What a recovery from a killed rank 2 printed (issue 35.6), as mpirun hands it over.
RECOVERY = (
    b"[0]<stderr>:NBC_Progress: an error 75 was found during schedule 0x7f971c010ed0 at "
    b"row-offset 0 - aborting the schedule\n"
    b"[0]<stderr>:\n"
    b"syncdp-run: rank 2 (pid 16005 on hb) was killed by signal 9 (SIGKILL).\n"
    b"[0]<stderr>:syncdp: rank 0: gradients.bucket0.check: a rank of the job failed "
    b"(MPI_ERR_PROC_FAILED: Process Failure); the collective was abandoned on every rank. "
    b"Recovering from the last commit.\n"
    b"[1]<stderr>:syncdp: rank 1: gradients.bucket0.check: a rank of the job failed "
    b"(MPI_ERR_REVOKED: Communication Object Revoked); the collective was abandoned on every "
    b"rank. Recovering from the last commit.\n"
    b"3 more processes have sent help message help-mpi-ft.txt / module:untested:failundef\n"
    b'Set MCA parameter "orte_base_help_aggregate" to 0 to see all help / error messages\n'
    b"[1]<stdout>:epoch 1\n"
    b"[1]<stdout>:\n"
    b"[0]<stderr>:a warning of the program's own\n"
)


def test_an_elastic_recovery_reads_as_one_and_the_rank_files_keep_every_line(tmp_path):
    files = output.RankFiles(str(tmp_path / "out"), 2)
    shown = _launcher(UNTESTED_BANNER + RECOVERY, files=files, recovery=output._Recovery()).decode()
    files.close()
    assert shown.splitlines() == [
        "syncdp-run: the ranks' and Open MPI's notes on the recovery (MPI_ERR_REVOKED, "
        "NBC_Progress) are not shown; --log-level DEBUG shows them, --output-filename keeps them",
        "[1]<stdout>:epoch 1",
        "[1]<stdout>:",  # the program's own empty line on stdout stays
        "[0]<stderr>:a warning of the program's own",
    ]
    kept = (tmp_path / "out" / "rank.0" / "stderr").read_text()
    assert "NBC_Progress: an error 75" in kept and "MPI_ERR_PROC_FAILED" in kept
    # Without the filter (--log-level DEBUG, or not elastic) every line passes.
    assert _launcher(UNTESTED_BANNER + RECOVERY, full_banners=True) == UNTESTED_BANNER + RECOVERY


# mpirun's banner when a restart's daemon could not start on hc (issue 35.6), as CI printed it.
DAEMON_BANNER = (
    b"--------------------------------------------------------------------------\n"
    b"A daemon failed to report back after being spawned. This could\n"
    b"be due to several factors, including inability to find the\n"
    b"daemon executable.\n"
    b"\n"
    b"  Local host:    vm\n"
    b"  Remote host:   hc\n"
    b"  Daemon exit status: 127\n"
    b"--------------------------------------------------------------------------\n"
)


def test_in_elastic_mode_the_banner_on_a_lost_daemon_is_left_to_the_launchers_account():
    named = []
    shown = _launcher(
        DAEMON_BANNER + b"[0]<stdout>:EPOCH 1 SIZE 1\n",
        recovery=output._Recovery(),
        on_banner=named.append,
    )
    assert shown == b"[0]<stdout>:EPOCH 1 SIZE 1\n"
    # The launcher still hears of it, and so names hc as lost.
    assert len(named) == 1 and "Remote host: hc" in named[0]
    # Outside elastic mode (or at --log-level DEBUG) it passes whole.
    assert _launcher(DAEMON_BANNER) == DAEMON_BANNER


# TensorFlow's records of the RankFailureError a Keras step's host call raised on rank 2, as a
# 3-rank job printed them when rank 1 was killed (examples/elastic_train.py, shortened).
_FAILED = (
    b"RankFailureError: distributed_sgd.bucket0.check: a rank of the job failed "
    b"(MPI_ERR_PROC_FAILED: Process Failure); the collective was abandoned on every rank.\n"
)
TF_RECORDS = (
    b"[2]<stderr>:W0000 00:00:1795701229.802001   27673 op_kernel.cc:1845] UNKNOWN: "
    + _FAILED
    + b"[2]<stderr>:Traceback (most recent call last):\n"
    b"[2]<stderr>:\n"
    b'[2]<stderr>:  File "/site-packages/tensorflow/python/ops/script_ops.py", line 269, in '
    b"__call__\n"
    b"[2]<stderr>:    ret = func(*args)\n"
    b"[2]<stderr>:          ^^^^^^^^^^^\n"
    b"[1]<stdout>:between the two, another rank's line\n"
    b'[2]<stderr>:  File "/work/main/syncdp/transport/communicator.py", line 188, in _run\n'
    b"[2]<stderr>:    raise failure from None\n"
    b"[2]<stderr>:\n"
    b"[2]<stderr>:syncdp.base.errors." + _FAILED + b"[2]<stderr>:\n"
    b"[2]<stderr>:\n"
    b"[2]<stderr>:W0000 00:00:1795701229.802082   27673 local_rendezvous.cc:412] Local rendezvous "
    b"is aborting with status: UNKNOWN: "
    + _FAILED
    + b"[2]<stderr>:Traceback (most recent call last):\n"
    b"[2]<stderr>:syncdp.base.errors." + _FAILED + b"[2]<stderr>:\n"
    b"[2]<stderr>:\t [[{{function_node __inference_one_step_on_data_840}}"
    b"{{node syncdp_bucket0/distributed_sgd_bucket0}}]]\n"
    b"[2]<stderr>:UserWarning: the program's own warning\n"
    b"[2]<stderr>:  with its own indented line\n"
)


def test_tensorflows_records_of_a_rank_failure_are_left_to_the_rank_files(tmp_path):
    files = output.RankFiles(str(tmp_path / "out"), 3)
    shown = _launcher(TF_RECORDS, files=files, recovery=output._Recovery()).decode()
    files.close()
    assert shown.splitlines()[1:] == [
        "[1]<stdout>:between the two, another rank's line",
        "[2]<stderr>:UserWarning: the program's own warning",
        "[2]<stderr>:  with its own indented line",
    ]
    assert shown.splitlines()[0].startswith("syncdp-run: the ranks' and Open MPI's notes")
    kept = (tmp_path / "out" / "rank.2" / "stderr").read_text()
    assert kept.count("RankFailureError") == 4 and "raise failure from None" in kept


def test_a_reader_that_goes_away_stops_the_console_not_the_copy(tmp_path):
    # syncdp-run ... | head -3: the console's pipe breaks after a few lines; the rest of
    # mpirun's output is still read to its end (nothing waits on a full pipe) and still
    # reaches --output-filename's files, without a traceback.
    class Head(io.BytesIO):
        def write(self, data):
            if self.getvalue().count(b"\n") >= 3:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(data)

    sent = b"".join(b"[0]<stdout>:line %d\n" % i for i in range(50))
    source, sink = io.BytesIO(sent), Head()
    files = output.RankFiles(str(tmp_path / "logs"), 1)
    output._pump(source, sink, timestamps=False, files=files)
    files.close()
    assert sink.getvalue().count(b"\n") == 3
    assert source.closed  # read to its end
    kept = (tmp_path / "logs" / "rank.0" / "stdout").read_bytes()
    assert kept == b"".join(b"line %d\n" % i for i in range(50))
