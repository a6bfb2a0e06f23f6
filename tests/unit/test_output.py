"""Long lines cross mpirun in pieces and come out whole, also interleaved with other ranks."""

import io

from launch import output, worker


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
