"""The timing table of a small model through the real launcher: its bandwidth column has a
unit in which the figures are not 0.00."""

from __future__ import annotations

import re

from tests.launcher import check, launch, python_script

JOB = """
import tensorflow as tf
import syncdp.tensorflow as hvd

hvd.init()
w = tf.Variable(tf.ones([256]))  # 1 KiB of gradients a step

@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    (g,) = hvd.DistributedGradientTape(tape).gradient(loss, [w])
    w.assign_sub(0.001 * g)

for _ in range(20):
    step()
"""


def test_a_small_models_bandwidth_is_shown_in_a_unit_that_means_something(tmp_path):
    result = check(launch(2, "python", python_script(tmp_path, JOB), timeout=180))
    err = result.stderr
    heading = re.search(
        r"^\s+rank\s+host\s+step ms\s+computing\s+waiting\s+moving\s+(\S+)$", err, re.M
    )
    assert heading, err[-2000:]
    rows = re.findall(r"^\s+(\d+)\s+\S+\s+[\d.]+\s+\d+%\s+\d+%\s+\d+%\s+(\S+)$", err, re.M)
    assert sorted(int(r[0]) for r in rows) == [0, 1], err[-2000:]
    # 1 KiB a step moves far below a gigabyte a second (it printed 0.00 GB/s): a smaller
    # unit, in which every rank's figure is above zero.
    assert heading[1] in ("MB/s", "kB/s"), err[-2000:]
    for _, rate in rows:
        assert rate != "0.00" and float(rate.lstrip("<")) > 0, err[-2000:]
    print(heading[0], *rows, sep="\n")
