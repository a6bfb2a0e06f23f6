"""Several hosts through ``syncdp-run -H``: network namespaces on this machine as real hosts.

Three namespace hosts (tests/netns.py: own addresses on a test subnet, own hostnames), two
ranks on each, started by Open MPI through a remote-shell agent. Checked: every rank runs on
its host with Horovod's local and cross ranks, collectives (topology-aware by default across
hosts, and flat) give the sums the mathematics gives, a short fit leaves identical weights;
then one host's link is cut mid-training and the job must end in bounded time, naming the host,
with nothing of it left running on any host. Skips, saying why, where namespaces cannot be
made; removes everything it made, also on failure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests.launcher import check, launch, python_script, start
from tests.netns import NamespaceHosts, Unavailable

HOSTS = ["h1", "h2", "h3"]


@pytest.fixture
def cluster(tmp_path):
    try:
        with NamespaceHosts(tmp_path, HOSTS) as hosts:
            yield hosts
    except Unavailable as e:
        pytest.skip(str(e))


def _flags(cluster, *extra):
    return (
        "-H",
        ",".join(f"{h}:2" for h in HOSTS),
        "--network-interface",
        cluster.subnet,
        "--mpi-args",
        f"--mca plm_rsh_agent {cluster.agent} --mca mpi_yield_when_idle 1",
        *extra,
    )


JOB = """
import os
import socket
import numpy as np
import tensorflow as tf
import keras
import syncdp
from syncdp.job import runtime

syncdp.init()
r, n = syncdp.rank(), syncdp.size()
host = socket.gethostname()
# The launcher's environment reaches every host, as horovodrun's does (the remote shell gives
# a bare one); its own host's name does not.
assert os.environ.get("PROJECT_DATA") == "/data/set 1", os.environ.get("PROJECT_DATA")
assert os.environ.get("HOSTNAME") != "launcher-host", host
comm = runtime.communicator()
# Horovod's local/cross ranks from shared memory: 2 ranks per host, ranks in host order.
hosts = syncdp.allgather_object(host)
assert hosts == ["h1", "h1", "h2", "h2", "h3", "h3"], hosts
assert (syncdp.local_rank(), syncdp.local_size()) == (r % 2, 2)
assert (syncdp.cross_rank(), syncdp.cross_size()) == (r // 2, 3)
assert comm.prefer_hierarchy, "3 hosts x 2 ranks must take the topology-aware path"
for hierarchical in (True, False):
    comm.prefer_hierarchy = hierarchical
    got = syncdp.allreduce(tf.fill([1000], float(r + 1)), op=syncdp.Sum).numpy()
    assert (got == n * (n + 1) / 2).all(), got[:4]
    got = syncdp.allreduce(tf.constant([r, -r], tf.int64), op=syncdp.Max).numpy()
    assert got.tolist() == [n - 1, 0], got
    big = np.arange(3_000_000, dtype=np.float64) * (r + 1)
    out = comm.allreduce(big)  # several chunks of 8 MiB
    assert np.array_equal(out, np.arange(3_000_000, dtype=np.float64) * (n * (n + 1) / 2))
comm.prefer_hierarchy = True
keras.utils.set_random_seed(1)
x = np.random.default_rng(r).normal(size=(64, 8)).astype("float32")
y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer=syncdp.keras.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss="mse", jit_compile=False)
model.fit(x, y, batch_size=16, epochs=2, verbose=0,
          callbacks=[syncdp.keras.callbacks.BroadcastGlobalVariablesCallback(0)])
syncdp.verify_synchronized(model.variables)
print(f"rank {r} on {host}: ok", flush=True)
"""


def test_six_ranks_on_three_hosts(cluster, tmp_path):
    script = python_script(tmp_path, JOB)
    env = {"PROJECT_DATA": "/data/set 1", "HOSTNAME": "launcher-host"}
    result = check(launch(6, "python", script, launcher_args=_flags(cluster), env=env, timeout=300))
    for r in range(6):
        assert f"[{r}]<stdout>:rank {r} on {HOSTS[r // 2]}: ok" in result.stdout


TUNED = """
import numpy as np
import tensorflow as tf
import syncdp.tensorflow as hvd

hvd.init()
w = tf.Variable(tf.ones([600_000]))  # 2.4 MB of gradients


@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w) * float(hvd.rank() + 1)
    (g,) = hvd.DistributedGradientTape(tape).gradient(loss, [w])
    w.assign_sub(0.01 * g)


for _ in range(40):
    step()
# Every step scaled w by 1 - 0.01 * 2 * mean(rank + 1), whatever the tuner picked.
expected = (1 - 0.02 * (hvd.size() + 1) / 2) ** 40
np.testing.assert_allclose(w.numpy(), expected, rtol=1e-5)
hvd.verify_synchronized([w])
print(f"rank {hvd.rank()}: tuned ok", flush=True)
"""


def test_autotune_across_hosts_also_tries_the_hierarchy(cluster, tmp_path):
    log = tmp_path / "tune.csv"
    tune = (
        "--autotune",
        "--autotune-warmup-samples",
        "1",
        "--autotune-steps-per-sample",
        "2",
        "--autotune-log-file",
        str(log),
    )
    script = python_script(tmp_path, TUNED)
    result = check(launch(6, "python", script, launcher_args=_flags(cluster, *tune), timeout=300))
    assert result.stdout.count("tuned ok") == 6, result.stdout
    samples = [line.split(",") for line in log.read_text().splitlines()[1:]]
    hierarchical = {row[5] for row in samples if row[1] == "sample"}
    assert hierarchical == {"0", "1"}, samples
    assert samples[-1][1] == "chosen"


LOOP = """
import time, sys
import numpy as np
import syncdp
from syncdp.job import runtime
syncdp.init()
comm = runtime.communicator()
buf = np.ones(1 << 16, np.float32)
for step in range(100000):
    comm.allreduce_inplace(buf, name="step")
    buf[:] = 1
    if step == 20:
        print("training", flush=True)
    time.sleep(0.01)
"""


def test_a_host_whose_link_is_cut_ends_the_job_and_leaves_nothing_running(cluster, tmp_path):
    stall = 5.0
    script = python_script(tmp_path, LOOP)
    proc = start(6, "python", script, launcher_args=_flags(cluster, "--stall-timeout", str(stall)))
    try:
        for line in proc.stdout:
            if "training" in line:
                break
        cut_at = time.monotonic()
        cluster.cut("h3")
        try:
            out, err = proc.communicate(timeout=stall + 15 + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the job did not end after its host's link was cut")
        ended = time.monotonic() - cut_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert ended < stall + 15 + 3, f"ended {ended:.1f} s after the cut\n{err[-3000:]}"
    # The failure names the stalled ranks and their host.
    assert re.search(r"ranks 4, 5 \(on h3\) stalled", err), err[-3000:]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(cluster.pids(h) for h in HOSTS):
        time.sleep(0.5)
    left = {h: cluster.pids(h) for h in HOSTS if cluster.pids(h)}
    assert not left, f"processes left on hosts {left}"


def test_a_host_that_cannot_be_reached_is_named_before_anything_starts(cluster, tmp_path):
    flags = list(_flags(cluster))
    flags[flags.index("-H") + 1] = "h1:2,h9:2"  # no such host: the remote shell cannot reach it
    result = launch(4, "python", "-c", "pass", launcher_args=tuple(flags), timeout=120)
    assert result.returncode != 0
    assert "cannot start the job" in result.stderr and "host h9:" in result.stderr, result.stderr
    assert "host h1" not in result.stderr
    assert "<stdout>" not in result.stdout  # nothing started
