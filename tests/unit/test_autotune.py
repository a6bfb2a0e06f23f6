"""The autotuner's search (syncdp.engine.autotune), driven by a simulated clock."""

import itertools
import random

import pytest

from syncdp.engine.autotune import DIMENSIONS, Choice, Tuner, csv_lines

MiB = 1 << 20
START = Choice(cap_bytes=25 * MiB, first_bytes=MiB, chunk_bytes=8 * MiB, hierarchical=False)


def run(tuner, cost, steps=2000, noise=None):
    """Ticks ``tuner`` through ``steps`` steps whose length is ``cost(choice)`` (+ noise),
    scoring each sample as one rank would; returns the number of steps taken to settle."""
    now = 0.0
    for step in range(steps):
        if tuner.tick(now):
            tuner.record(tuner.local_score())
        if tuner.settled:
            return step
        now += cost(tuner.choice) + (noise() if noise else 0.0)
    raise AssertionError("the tuner never settled")


def tuner(**kw):
    options = dict(warmup_samples=2, steps_per_sample=5, max_samples=40)
    options.update(kw)
    return Tuner(START, **options)


def bowl(best: Choice):
    """A step time with its minimum at ``best``, rising along each dimension."""
    order = {name: list(values) for name, values in DIMENSIONS.items()}

    def cost(c: Choice) -> float:
        t = 0.1
        for name in ("cap_bytes", "first_bytes", "chunk_bytes", "hierarchical"):
            values = order[name]
            t += 0.01 * abs(values.index(getattr(c, name)) - values.index(getattr(best, name)))
        return t

    return cost


@pytest.mark.parametrize(
    "best",
    [
        Choice(2 * MiB, 0, MiB, True),
        Choice(64 * MiB, MiB // 4, 32 * MiB, False),
        START,
    ],
)
def test_it_finds_the_fastest_choice_of_every_dimension(best):
    t = tuner(active=lambda name: True)
    run(t, bowl(best))
    assert t.settled and t.choice == t.best == best
    assert t.rows[-1]["kind"] == "chosen"
    assert t.rows[-1]["step_ms"] == pytest.approx(100.0)


def test_noise_that_only_adds_time_does_not_mislead_it():
    rng = random.Random(3)
    best = Choice(8 * MiB, 4 * MiB, 8 * MiB, False)
    # Other jobs steal time now and then: a step is sometimes 30% longer, never shorter.
    t = tuner(active=lambda name: name == "chunk_bytes")
    run(t, bowl(best), noise=lambda: 0.03 * (rng.random() < 0.2))
    assert t.choice == best


def test_warmup_samples_are_thrown_away_and_never_chosen():
    t = tuner(warmup_samples=3)
    first_steps = []

    def cost(c):
        # Tracing makes the first steps slow whatever the choice.
        first_steps.append(c)
        return 5.0 if len(first_steps) <= 15 else bowl(START)(c)

    run(t, cost)
    assert [r["kind"] for r in t.rows[:3]] == ["warmup"] * 3
    assert all(r["kind"] != "warmup" for r in t.rows[3:])
    assert t.choice == START
    assert all(score < 1.0 for score in t.scores.values())


def test_it_measures_no_more_than_max_samples_and_keeps_the_best_seen():
    t = tuner(max_samples=3, active=lambda name: True)
    run(t, bowl(Choice(2 * MiB, 0, MiB, True)))
    samples = [r for r in t.rows if r["kind"] == "sample"]
    assert len(samples) == 3
    assert t.best == min(t.scores, key=t.scores.get)
    assert t.choice == t.best


def test_choices_with_the_same_buckets_share_one_measurement():
    t = tuner(active=lambda name: False)
    # One call site whose gradients fit any bucket: every (first, cap) pair plans alike.
    t.note_plans(("gradients", (1000,)), {pair: "one bucket" for pair in t.plan_grid})
    run(t, bowl(START))
    samples = [r for r in t.rows if r["kind"] == "sample"]
    assert len(samples) == 4  # one per sweep: cap, first bucket, then both again
    assert t.choice == START  # ties keep the configured value


def test_only_active_dimensions_are_searched():
    t = tuner(active=lambda name: False)
    run(t, bowl(Choice(2 * MiB, 0, MiB, True)))
    assert t.tuned == ("cap_bytes", "first_bytes")
    assert {r["chunk_mb"] for r in t.rows} == {8.0}
    assert {r["hierarchical"] for r in t.rows} == {0}
    assert (t.choice.chunk_bytes, t.choice.hierarchical) == (8 * MiB, False)
    assert (t.choice.cap_bytes, t.choice.first_bytes) == (2 * MiB, 0)


def test_the_configured_values_are_always_candidates():
    odd = Choice(cap_bytes=3 * MiB, first_bytes=123, chunk_bytes=5 * MiB, hierarchical=True)
    t = Tuner(odd, warmup_samples=0, steps_per_sample=1, max_samples=1)
    assert 3 * MiB in t.values["cap_bytes"] and 123 in t.values["first_bytes"]
    assert set(t.plan_grid) == set(
        itertools.product(t.values["first_bytes"], t.values["cap_bytes"])
    )
    assert t.plan_grid[t.plan_index()] == (123, 3 * MiB)


def test_a_sample_scores_its_median_step():
    t = tuner(warmup_samples=0, steps_per_sample=3)
    ticks = [0.0, 1.0, 1.5, 11.5]  # steps of 1, 0.5 and 10 s: the median is 1
    assert [t.tick(x) for x in ticks] == [False, False, False, True]
    assert t.local_score() == 1.0


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        Tuner(START, warmup_samples=0, steps_per_sample=0, max_samples=1)
    with pytest.raises(ValueError):
        Tuner(START, warmup_samples=0, steps_per_sample=1, max_samples=0)


def test_the_log_is_csv_with_a_header():
    t = tuner()
    run(t, bowl(START))
    lines = csv_lines(t.rows)
    assert (
        lines[0] == "sample,kind,fusion_threshold_mb,first_bucket_mb,chunk_mb,hierarchical,step_ms"
    )
    assert len(lines) == len(t.rows) + 1
    assert lines[-1].split(",")[1] == "chosen"
    assert "autotune chose fusion threshold 25 MiB, first bucket 1 MiB" in t.summary()


def test_without_warmup_the_first_sample_is_the_configured_choice_and_the_search_goes_on():
    best = Choice(8 * MiB, 0, 8 * MiB, False)
    t = tuner(warmup_samples=0, active=lambda name: False)
    run(t, bowl(best))
    assert t.rows[0]["kind"] == "sample" and t.rows[0]["fusion_threshold_mb"] == 25
    assert len([r for r in t.rows if r["kind"] == "sample"]) > 1
    assert t.choice == best
