"""Rank 0's timeline file, written as events happen: whole JSON after each, however it ends."""

import json

import pytest

from syncdp.watch.timeline import Timeline


def _trace(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_the_file_is_whole_json_after_every_event(tmp_path):
    path = tmp_path / "sub" / "trace.json"  # its directory is made
    timeline = Timeline(str(path), every_rank=False)
    timeline.start(0)
    assert [e["ph"] for e in _trace(path)] == ["M"] * 4  # rank 0's rows, named
    for i in range(3):
        timeline.record(f"c{i}", 8, "float32", 1.0 + i, 1.5 + i)
        timeline.mark(f"gradient {i}", 2.0 + i)
        collectives = [e for e in _trace(path) if e["ph"] == "X"]
        assert [(e["name"], e["args"]["seq"]) for e in collectives] == [
            (f"c{k}", k) for k in range(i + 1)
        ]
    assert timeline.stop() == str(path)
    assert len(_trace(path)) == 4 + 6
    assert timeline.events == []  # rank 0's own events are in the file, not kept


def test_other_ranks_write_nothing_until_one_becomes_rank_0(tmp_path):
    path = tmp_path / "trace.json"
    timeline = Timeline(str(path))
    timeline.start(1)
    timeline.record("c0", 8, "float32", 1.0, 1.5)
    assert not path.exists() and len(timeline.events) == 1  # kept for the gather at the end
    timeline.set_rank(0)  # elastic mode: rank 0 was lost
    timeline.record("c1", 8, "float32", 2.0, 2.5)
    assert [e["name"] for e in _trace(path) if e["ph"] == "X"] == ["c1"]


def test_a_write_that_fails_stops_the_timeline_and_leaves_the_events_so_far(tmp_path, capsys):
    path = tmp_path / "trace.json"
    timeline = Timeline(str(path), every_rank=False)
    timeline.start(0)
    timeline.record("c0", 8, "float32", 1.0, 1.5)
    stream = timeline._stream._file
    real_write = stream.write
    calls = []

    class Full:  # the disk fills up halfway through the next event
        def __getattr__(self, name):
            return getattr(stream, name)

        def write(self, data):
            calls.append(data)
            if len(calls) == 1:
                real_write(data[:5])
                raise OSError(28, "No space left on device")
            return real_write(data)

    timeline._stream._file = Full()
    timeline.record("c1", 8, "float32", 2.0, 2.5)
    timeline.record("c2", 8, "float32", 3.0, 3.5)  # nothing more is written
    assert [e["name"] for e in _trace(path) if e["ph"] == "X"] == ["c0"]
    assert "the timeline stops here" in capsys.readouterr().err


def test_a_path_rank_0_cannot_write_is_named_when_the_timeline_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError, match="the timeline cannot be written to"):
        Timeline(str(blocker / "trace.json")).start(0)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_full_timeline_keeps_its_first_events_and_says_where_it_stopped(tmp_path, capsys, rank):
    """A job's timeline is held in memory until the end: each rank keeps at most max_events,
    then a note, and nothing more (rank 0's file likewise); rank 0 says so once."""
    path = tmp_path / "trace.json"
    timeline = Timeline(str(path), max_events=3)
    timeline.start(rank)
    for i in range(5):
        timeline.record(f"c{i}", 8, "float32", 1.0 + i, 1.5 + i)
        timeline.mark(f"gradient {i}", 1.2 + i)
    names = [e["name"] for e in timeline.events]
    assert names[:3] == ["c0", "gradient 0", "c1"]
    assert len(names) == 4 and names[3].startswith("timeline full: later events of this rank")
    said = capsys.readouterr().err
    if rank == 0:
        assert said.count("the timeline holds 3 events per rank at most") == 1
        streamed = [e["name"] for e in _trace(path) if e["ph"] != "M"]
        assert streamed == names
    else:
        assert said == "" and not path.exists()
