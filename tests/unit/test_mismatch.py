"""The MismatchError message: what each rank passed, from every rank's (name, signature)."""

import numpy as np

from syncdp.transport.communicator import _mismatch_message


def test_ranks_in_different_collectives_are_named_with_their_collectives():
    everyone = [
        ("gradients.bucket0", (("name", "gradients.bucket0"), ("dtype", "float32"))),
        ("MetricAverageCallback", (("name", "MetricAverageCallback"), ("collective", "x"))),
    ]
    text = _mismatch_message("gradients.bucket0", everyone)
    assert text.startswith("gradients.bucket0: the ranks are in different collectives (")
    assert "rank 0 in gradients.bucket0 (dtype=float32); rank 1 in MetricAverageCallback " in text
    assert "(collective=x))" in text
    assert "uneven data" in text


def test_a_field_that_repeats_the_collectives_name_is_left_out():
    everyone = [("barrier", (("collective", "barrier"),)), ("elastic.commit_check", ())]
    text = _mismatch_message("barrier", everyone)
    assert "(rank 0 in barrier; rank 1 in elastic.commit_check)" in text


def test_the_same_collective_names_only_the_fields_that_differ():
    sig = (("name", "b"), ("collective", "broadcast_object"))
    everyone = [("b", (*sig, ("root", 0))), ("b", (*sig, ("root", 1))), ("b", (*sig, ("root", 0)))]
    text = _mismatch_message("b", everyone)
    assert "b: ranks passed different root (rank 0: root=0; rank 1: root=1; rank 2: root=0)" in text


def test_fields_are_compared_by_name_not_by_position():
    # Rank 1's signature has no "op" and its "shape" comes first: nothing is left blank.
    everyone = [
        ("t", (("name", "t"), ("op", "sum"), ("shape", (2,)))),
        ("t", (("name", "t"), ("shape", (3,)))),
    ]
    text = _mismatch_message("t", everyone)
    expected = "ranks passed different op, shape (rank 0: op=sum, shape=(2,); rank 1: shape=(3,))"
    assert expected in text


def test_a_long_signature_is_cut():
    everyone = [("t", (("shapes", tuple(range(500))),)), ("t", (("shapes", ()),))]
    text = _mismatch_message("t", everyone)
    assert "..." in text and len(text) < 1000


def test_ranks_not_all_taking_part_are_named_by_their_own_numbers():
    # Rank 0 has joined: only ranks 1 and 2 passed signatures.
    everyone = [("t", (("name", "t"), ("shape", (1,)))), ("t", (("name", "t"), ("shape", (2,))))]
    text = _mismatch_message("t", everyone, [1, 2])
    assert "ranks passed different shape (rank 1: shape=(1,); rank 2: shape=(2,))" in text


def test_missing_gradients_are_compared_by_position_and_shown_by_name():
    import pickle

    from syncdp.tensorflow.tape import _Absent
    from syncdp.transport.communicator import signature_digest

    # Rank 0's model was built second in its process: its names are numbered differently.
    mine, theirs = _Absent([3], "dense_1/bias"), _Absent([3], "dense/bias")
    assert signature_digest((("no_gradient", mine),)) == signature_digest(
        (("no_gradient", theirs),)
    )
    copy = pickle.loads(pickle.dumps(mine))
    assert copy == (3,) and str(copy) == "dense_1/bias"
    everyone = [("g", (("name", "g"),)), ("g", (("name", "g"), ("no_gradient", theirs)))]
    text = _mismatch_message("g", everyone)
    assert "rank 1: no_gradient=dense/bias" in text


def test_a_numpy_scalar_and_the_python_number_it_equals_have_one_digest():
    from syncdp.transport.communicator import signature_digest

    plain = (("name", "x"), ("root", 1), ("shape", (2, 3)), ("seed", [7]))
    numpy = (
        ("name", "x"),
        ("root", np.int64(1)),
        ("shape", (np.int32(2), 3)),
        ("seed", [np.uint8(7)]),
    )
    assert signature_digest(plain) == signature_digest(numpy)
    assert signature_digest(plain) != signature_digest(
        (("name", "x"), ("root", 2), ("shape", (2, 3)), ("seed", [7]))
    )
