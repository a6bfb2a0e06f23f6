"""Long lines cross mpirun in pieces and come out whole, also interleaved with other ranks."""

import io
import os
import subprocess
import sys
import time

from syncdp.launch import output, worker


def _through_supervisor(rank: int, stream: str, text: bytes) -> bytes:
    sink = io.BytesIO()
    worker._pump(io.BytesIO(text), sink, f"[{rank}]<{stream}>:".encode())
    return sink.getvalue()


def test_a_long_line_is_sent_in_marked_pieces_and_joined_back():
    piece = output.PIECE_BYTES
    long_line = b"a" * (3 * piece + 5) + b"\n"
    exact = b"b" * (2 * piece - 1) + b"\n"  # the newline ends the second piece
    sent = _through_supervisor(1, "stdout", long_line + b"short\n" + exact)
    lines = sent.splitlines(keepends=True)
    assert len(lines) == 4 + 1 + 2
    assert all(
        len(line) <= piece + len(b"[1]<stdout>:") + len(output.CONTINUED) + 1 for line in lines
    )
    # Another rank's lines arrive between the pieces, as mpirun may interleave them.
    other = _through_supervisor(0, "stdout", b"hello\n")
    mixed = lines[0] + other + b"".join(lines[1:])
    sink = io.BytesIO()
    output._pump(io.BytesIO(mixed), sink, timestamps=False, files=None)
    assert sink.getvalue() == (
        b"[0]<stdout>:hello\n"
        + b"[1]<stdout>:"
        + long_line
        + b"[1]<stdout>:short\n"
        + b"[1]<stdout>:"
        + exact
    )


def test_a_rank_that_ends_inside_a_long_line_still_shows_what_it_wrote(tmp_path):
    sent = _through_supervisor(2, "stderr", b"c" * (output.PIECE_BYTES + 10))  # no newline
    first = sent.splitlines(keepends=True)[0]  # the rank died before the last piece
    sink = io.BytesIO()
    files = output.RankFiles(str(tmp_path), 3)
    output._pump(io.BytesIO(first), sink, timestamps=False, files=files)
    assert sink.getvalue() == b"[2]<stderr>:" + b"c" * output.PIECE_BYTES + b"\n"


# What TensorFlow 2.21 prints on a rank's stderr as it starts on a host without CUDA drivers
# (rank 0), then a rank that found a driver but no device (rank 1), a warning and the program.
_A = b"00:00:1795659470.400969   22888 "  # absl's date, time and thread (messages shortened)
STARTUP_LINES = [
    b"[0]<stderr>:WARNING: All log messages before absl::InitializeLog() is called are "
    b"written to STDERR",
    b"[0]<stderr>:I0000 " + _A + b"port.cc:153] oneDNN custom operations are on. You may see",
    b"[0]<stderr>:I0000 " + _A + b"cudart_stub.cc:31] Could not find cuda drivers on your",
    b"[0]<stderr>:I0000 " + _A + b"cpu_feature_guard.cc:227] This TensorFlow binary is optimized",
    b"[0]<stderr>:To enable the following instructions: AVX2 FMA, in other operations, rebuild "
    b"TensorFlow with the appropriate compiler flags.",
    b"[0]<stderr>:E0000 " + _A + b"cuda_platform.cc:52] failed call to cuInit: (303)",
    b"[1]<stderr>:E0000 " + _A + b"cuda_platform.cc:52] failed call to cuInit: (100)",
    b"[0]<stderr>:W0000 " + _A + b"op_kernel.cc:1830] OP_REQUIRES failed: a real warning",
    b"[0]<stdout>:hello from rank 0",
]
STARTUP = b"\n".join(STARTUP_LINES) + b"\n"


def test_tensorflows_startup_chatter_is_one_line_unless_debug(tmp_path):
    sink = io.BytesIO()
    files = output.RankFiles(str(tmp_path), 2)
    output._pump(io.BytesIO(STARTUP), sink, timestamps=False, files=files, quiet=output._Chatter())
    files.close()
    lines = sink.getvalue().splitlines()
    assert lines[0].startswith(b"syncdp-run: start-up messages (TensorFlow's")
    assert b"--log-level DEBUG" in lines[0]
    # Kept: errors that are news (rank 1 has a driver, so its cuInit failure is), warnings and
    # the program's output.
    assert lines[1:] == STARTUP_LINES[6:]
    # The rank's own files keep every line.
    assert (tmp_path / "rank.0" / "stderr").read_bytes().count(b"\n") == 7
    # At --log-level DEBUG (no filter) everything reaches the console as it came.
    sink = io.BytesIO()
    output._pump(io.BytesIO(STARTUP), sink, timestamps=False, files=None)
    assert sink.getvalue() == STARTUP


# What each rank of a job printed first on the 16-core measuring machine (it has an RDMA device
# that Open MPI's UCX one-sided component could not use): the query's error, then an empty line.
UCX_LINES = [
    b"[1]<stderr>:[vm:05056] /openmpi-5.0.11/ompi/mca/osc/ucx/osc_ucx_component.c:375  Error: "
    b"OSC UCX component priority set inside component query failed ",
    b"[0]<stderr>:[vm:05068] /openmpi-5.0.11/ompi/mca/osc/ucx/osc_ucx_component.c:375  Error: "
    b"OSC UCX component priority set inside component query failed ",
    b"[1]<stderr>: ",
    b"[0]<stderr>: ",
    b"[0]<stderr>:",  # an empty line of the program's own is kept
    b"[1]<stdout>:step 1",
]


def test_open_mpis_ucx_query_error_and_its_empty_line_are_start_up_chatter(tmp_path):
    sink = io.BytesIO()
    files = output.RankFiles(str(tmp_path), 2)
    raw = b"\n".join(UCX_LINES) + b"\n"
    output._pump(io.BytesIO(raw), sink, timestamps=False, files=files, quiet=output._Chatter())
    files.close()
    lines = sink.getvalue().splitlines()
    assert lines[0].startswith(b"syncdp-run: start-up messages")
    assert lines[1:] == UCX_LINES[4:]
    assert b"UCX" in (tmp_path / "rank.1" / "stderr").read_bytes()  # the rank's file keeps it


def test_a_job_started_again_says_each_note_once(tmp_path):
    # An elastic job that restarted after a lost host printed the start-up and recovery notes
    # once per runtime; they are said once per job (the same set goes to every runtime).
    said: set[bytes] = set()
    printed = b""
    recovering = b"[1]<stderr>:NBC_Progress: an error 75 was found during schedule 3\n"
    for _ in range(2):  # two runtimes of one job
        sink = io.BytesIO()
        output._pump(
            io.BytesIO(STARTUP + recovering),
            sink,
            timestamps=False,
            files=None,
            quiet=output._Chatter(),
            recovery=output._Recovery(),
            said=said,
        )
        printed += sink.getvalue()
    assert printed.count(b"syncdp-run: start-up messages") == 1
    assert printed.count(b"notes on the recovery") == 1
    assert printed.count(b"hello from rank 0") == 2  # the program's own lines, every time


def test_the_supervisor_forwards_all_its_ranks_output_to_a_slow_reader():
    # The rank writes more than a pipe holds and ends at once; mpirun (here: a reader that
    # sleeps past the supervisor's quiet limit) takes it slowly. Nothing may be dropped.
    rank = "import sys\nfor i in range(1000): print(i, 'x' * 100)\nprint('last', file=sys.stderr)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SYNCDP_", "OMPI_"))}
    env["OMPI_COMM_WORLD_RANK"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "syncdp.launch.worker", sys.executable, "-c", rank],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        time.sleep(worker._QUIET_OUTPUT_SECONDS + 2)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.splitlines() == [b"[1]<stdout>:%d " % i + b"x" * 100 for i in range(1000)]
    assert err == b"[1]<stderr>:last\n"
    assert proc.returncode == 0
