"""The engine end to end: multi-process through `fastxfer run`, results checked exactly."""

import pytest

from _launch import assert_ok, launch

W = "collectives_worker.py"
# the modes that share one job per rank count (the worker runs them one after the other); the
# engine-thread, join and bits16 checks keep jobs of their own
SHARED = {1: ["sweep", "adasum"], 2: ["sweep", "compressed", "collectives", "dtypes15", "alltoall", "reducescatter",
                                   "adasum", "eager"],
          3: ["info", "sweep", "compressed", "dtypes15", "alltoall", "reducescatter", "adasum", "eager"],
          4: ["sweep", "collectives", "adasum"]}


@pytest.fixture(scope="module")
def shared_job():
    """shared_job(np_, mode): the CompletedProcess of the one job of SHARED[np_] (started the first
    time a test asks for it)."""
    jobs = {}

    def job(np_, mode):
        assert mode in SHARED[np_], (np_, mode)
        if np_ not in jobs:
            jobs[np_] = launch(np_, W, ",".join(SHARED[np_]))
        return jobs[np_]

    return job


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_every_dtype_op_and_size_exact(shared_job, np_):
    # sizes 0, 1, odd, and larger than the staging window and the bucket cap
    assert_ok(shared_job(np_, "sweep"), np_, "sweep")


@pytest.mark.parametrize("np_", [2, 3])
def test_compressed_allreduce_matches_its_exact_contract(shared_job, np_):
    assert_ok(shared_job(np_, "compressed"), np_, "compressed")


def test_bf16_fp16_arrays_exact_bits_on_every_simd_level():
    """bf16/fp16 arrays on 2 ranks, sum/average/min/max: hand-worked bit patterns (NaN, inf,
    subnormals, rounding ties, overflow, signed zeros) on every kernel path, and the same digest of
    random-bit-pattern results on every path as on the scalar reference."""
    import fastxfer as fx

    digests = {}
    for level in fx.supported_simd_levels():
        r = launch(2, W, "bits16", env={"FASTXFER_SIMD": level})
        lines = assert_ok(r, 2, "bits16")
        assert all(f"OK bits16 {level} " in line for line in lines), lines
        per_rank = [sorted(line.split("DIGEST ", 1)[1].rsplit(" rank", 1)[0] for line in r.stdout.splitlines()
                           if "DIGEST " in line and line.rstrip().endswith(f"rank {k}")) for k in (0, 1)]
        assert len(per_rank[0]) == 8 and per_rank[0] == per_rank[1], r.stdout  # both ranks hold the same result
        digests[level] = per_rank[0]
    assert "scalar" in digests
    for level, got in digests.items():
        assert got == digests["scalar"], f"{level} differs from the scalar reference"


@pytest.mark.parametrize("np_", [2, 4])
def test_broadcast_allgather_async_inplace_oob(shared_job, np_):
    assert_ok(shared_job(np_, "collectives"), np_, "collectives")


def test_synchronous_calls_leave_the_engine_thread_asleep():
    """1000 synchronous 1 MiB allreduces on 2 ranks: each rank runs its rounds on the calling thread,
    and its engine thread wakes only for its 50 ms idle check (it used to be woken once per call,
    a context switch on the caller's core each time)."""
    assert_ok(launch(2, W, "quiet_engine"), 2, "quiet_engine")


@pytest.mark.parametrize("np_", [2, 3])
def test_small_allreduces_travel_with_the_records_and_give_the_same_bits(shared_job, np_):
    """Buckets up to FASTXFER_EAGER_KB take the one-exchange path and larger ones the chunks; exact
    results and the chunk path's rounding on both sides of the limit; ranks whose queues differ
    at a round's start run the same buckets; a disagreement inside an offered run fails alone."""
    assert_ok(shared_job(np_, "eager"), np_, "eager")


@pytest.mark.parametrize("np_", [2, 3])
def test_new_dtypes_and_product_exact(shared_job, np_):
    """uint8/int8/uint16/int16/int32/int64 x sum/average/min/max/product with wrap-around, bool
    or/and, product on the float dtypes, broadcast/allgather of the new dtypes (issue 15)."""
    assert_ok(shared_job(np_, "dtypes15"), np_, "dtypes15")


@pytest.mark.parametrize("np_", [2, 3])
def test_alltoall_exact(shared_job, np_):
    """Even, uneven, empty, one-way and larger-than-window splits; several dtypes and dimensions;
    async; bad splits refused on the rank that passed them."""
    assert_ok(shared_job(np_, "alltoall"), np_, "alltoall")


@pytest.mark.parametrize("np_", [2, 3])
def test_reducescatter_exact(shared_job, np_):
    """Rows split as Horovod does (the first rows mod size ranks get one more), fewer rows than
    ranks, past the window, integer averages truncated, grouped, scaled."""
    assert_ok(shared_job(np_, "reducescatter"), np_, "reducescatter")


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_adasum_against_a_float64_reference(shared_job, np_):
    """op='adasum': power-of-two sizes (1, 2, 4) and the fold for 3 (tests/workers/collectives_worker.py)."""
    for line in assert_ok(shared_job(np_, "adasum"), np_, "adasum"):
        assert line.endswith(": 23 checks"), line


def test_join_stands_in_with_the_neutral_element_of_product_and_the_new_dtypes():
    assert_ok(launch(3, W, "join15"), 3, "join15")


def test_layout_from_launcher(shared_job):
    r = shared_job(3, "info")
    assert r.returncode == 0, r.stderr
    for k in range(3):
        assert f"[{k}] INFO rank={k} size=3 local_rank={k} local_size=3" in r.stdout
