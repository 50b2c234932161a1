"""Horovod's explicit gradient groups, without a job: the num_groups split rule, groups of
variables (the rest alone, after them), and the argument checks (fastxfer/tensorflow/tape.py)."""

import warnings

import pytest

tf = pytest.importorskip("tensorflow")

from fastxfer.tensorflow.tape import check_groups, explicit_groups, split_list  # noqa: E402


def test_split_list_gives_the_first_len_mod_n_pieces_one_more_as_horovod():
    assert split_list(list(range(5)), 3) == [[0, 1], [2, 3], [4]]
    assert split_list(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_list([0, 1], 3) == [[0], [1], []]


def test_int_groups_cut_the_candidates_in_order_and_drop_empty_pieces():
    assert explicit_groups(2, [0, 2, 3, 5, 6], [None] * 7) == [[0, 2, 3], [5, 6]]
    assert explicit_groups(4, [1, 4], [None] * 5) == [[1], [4]]


def test_variable_groups_come_first_and_every_other_variable_is_alone():
    vs = [tf.Variable(float(i)) for i in range(5)]
    got = explicit_groups([[vs[3], vs[0]], [vs[2]], []], [0, 1, 2, 3, 4], vs)
    assert got == [[0, 3], [2], [1], [4]]
    assert explicit_groups([[vs[3], vs[0]]], [1, 3, 4], vs) == [[3], [1], [4]]  # 0: None or local


def test_bad_groups_are_value_errors_naming_the_argument():
    v = tf.Variable(1.0)
    for kw in [{"num_groups": -1}, {"num_groups": 2.0}, {"num_groups": True}]:
        with pytest.raises(ValueError, match="num_groups must be a non-negative int"):
            check_groups(**kw)
    for groups in [0, -3, "ab", [v], [[1.0]], [[v], "x"]]:
        with pytest.raises(ValueError, match="groups should be a"):
            check_groups(groups=groups)
    with pytest.raises(ValueError, match="not both"):
        check_groups(num_groups=2, groups=[[v]])
    assert check_groups() is None and check_groups(0, None) is None
    assert check_groups(groups=3) == 3 and check_groups(groups=([v],)) == [[v]]
    with pytest.warns(DeprecationWarning, match="num_groups"):
        assert check_groups(num_groups=2) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_groups(groups=2)  # the current spelling warns about nothing
