"""The engine end to end: multi-process through `fastxfer run`, results checked exactly."""

import pytest

from _launch import assert_ok, launch

W = "collectives_worker.py"


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_every_dtype_op_and_size_exact(np_):
    # sizes 0, 1, odd, and larger than the staging window and the bucket cap
    assert_ok(launch(np_, W, "sweep"), np_, "sweep")


@pytest.mark.parametrize("np_", [2, 3])
def test_compressed_allreduce_matches_its_exact_contract(np_):
    assert_ok(launch(np_, W, "compressed"), np_, "compressed")


@pytest.mark.parametrize("np_", [2, 4])
def test_broadcast_allgather_async_inplace_oob(np_):
    assert_ok(launch(np_, W, "collectives"), np_, "collectives")


def test_layout_from_launcher():
    r = launch(3, W, "info")
    assert r.returncode == 0, r.stderr
    for k in range(3):
        assert f"[{k}] INFO rank={k} size=3 local_rank={k} local_size=3" in r.stdout
