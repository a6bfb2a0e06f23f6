"""The timeline: valid Chrome-trace JSON with one event per collective per rank."""

import json

import pytest

from syncdp.core.timeline import load
from tests.launcher import check, launch, python_script

JOB = """
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
import syncdp

syncdp.init()
step = tf.function(lambda ts: syncdp.grouped_allreduce(ts, name="tl", fusion_threshold=1024))
for _ in range(3):
    step([tf.ones([100]), tf.ones([1000]), tf.ones([3], tf.int32)])  # 3 buckets a step
syncdp.allreduce(tf.ones([4]), name="tl_eager")
syncdp.broadcast(tf.ones([2]), name="tl_bcast")
"""


@pytest.mark.parametrize("np_", [1, 2])
def test_timeline_one_event_per_collective_per_rank(tmp_path, np_):
    trace = tmp_path / "trace.json"
    check(
        launch(
            np_,
            "python",
            python_script(tmp_path, JOB),
            launcher_args=("--timeline-filename", str(trace)),
            timeout=240,
        )
    )
    data = json.loads(trace.read_text())  # valid JSON
    assert isinstance(data["traceEvents"], list)
    ranks = load(str(trace))
    assert sorted(ranks) == list(range(np_))
    names = {r: [e["name"] for e in events] for r, events in ranks.items()}
    for r, events in ranks.items():
        assert names[r] == names[0]  # the same collectives, in the same order, on every rank
        for e in events:
            assert e["ph"] == "X" and e["dur"] >= 0 and e["pid"] == r
            assert {"bytes", "dtype"} <= set(e["args"])
    mine = [n for n in names[0] if n.startswith("tl")]
    if np_ == 1:
        assert mine == []  # one rank reduces nothing: no collective happens
        return
    expected = ["tl.bucket0", "tl.bucket1", "tl.bucket2"] * 3 + ["tl_eager.bucket0", "tl_bcast"]
    assert mine == expected
    bucket = next(e for e in ranks[1] if e["name"] == "tl.bucket1")
    assert bucket["args"]["bytes"] == 4000 and bucket["args"]["dtype"] == "float32"
    assert bucket["args"]["tensors"] == 1
