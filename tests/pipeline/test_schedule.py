"""Pipeline schedules as data: every builder's lists are complete, deadlock-free, and
have the memory and bubble properties their schedule promises (pure, no processes)."""
import pytest

from globaltensor.pipeline import schedule as S

GRID = [(stages, micro) for stages in (1, 2, 3, 4) for micro in (1, 2, 3, 4, 5, 8)]


def one_per_worker(n):
    return tuple(range(n))


def round_robin(n_stages, workers):
    return tuple(k % workers for k in range(n_stages))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", GRID)
def test_one_stage_per_worker_runs_every_compute_once(name, stages, micro):
    lists = S.build(name, stages, micro, one_per_worker(stages))
    computes = [(a.kind, a.stage, a.mb) for acts in lists for a in acts
                if a.kind in (S.FORWARD, S.BACKWARD)]
    assert sorted(computes) == sorted({(k, s, i) for k in "FB" for s in range(stages)
                                       for i in range(micro)})
    S.simulate(lists, one_per_worker(stages), stages, micro)  # raises on a deadlock


@pytest.mark.parametrize("workers,chunks,micro", [(w, v, m) for w in (1, 2, 3, 4)
                                                  for v in (1, 2, 3) for m in range(1, 11)])
def test_interleaved_never_deadlocks(workers, chunks, micro):
    # short last rounds included (micro not a multiple of workers)
    n = workers * chunks
    lists = S.build("interleaved_1f1b", n, micro, round_robin(n, workers))
    assert len(lists) == workers


def test_receive_is_posted_before_the_compute_ahead_of_its_consumer():
    lists = S.build("1f1b", 2, 3, (0, 1))
    last = [str(a) for a in lists[1]]
    # stage 1 posts the receive of micro-batch 1 before it computes micro-batch 0's backward
    assert last.index("recv_act(0,1)") < last.index("B0.1") < last.index("F1.1")
    first = [str(a) for a in lists[0]]
    assert first.index("F0.0") + 1 == first.index("send_act(0,0)")


def test_1f1b_holds_fewer_micro_batches_than_gpipe():
    stages, micro = 4, 8
    for_1f1b = S.simulate(S.build("1f1b", stages, micro, one_per_worker(stages)),
                          one_per_worker(stages), stages, micro)
    for_gpipe = S.simulate(S.build("gpipe", stages, micro, one_per_worker(stages)),
                           one_per_worker(stages), stages, micro)
    assert for_gpipe.peak_in_flight == (micro,) * stages
    assert for_1f1b.peak_in_flight == tuple(stages - k for k in range(stages))
    assert for_1f1b.makespan == for_gpipe.makespan  # same bubble, less memory


def test_interleaving_shrinks_the_bubble():
    workers, micro = 4, 8
    plain = S.simulate(S.build("1f1b", workers, micro, one_per_worker(workers)),
                       one_per_worker(workers), workers, micro)
    n = 2 * workers
    # the same model cut into twice as many stages of half the cost each
    inter = S.simulate(S.build("interleaved_1f1b", n, micro, round_robin(n, workers)),
                       round_robin(n, workers), n, micro, 0.5, 1.0)
    assert inter.bubble < plain.bubble
    ideal = (workers - 1) / (micro + workers - 1)  # the 1F1B bubble fraction
    assert plain.bubble == pytest.approx(ideal)


def test_bubble_shrinks_with_more_micro_batches():
    bubbles = [S.simulate(S.build("gpipe", 2, m, (0, 1)), (0, 1), 2, m).bubble
               for m in (1, 2, 4, 8)]
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[0] == pytest.approx(0.5)


def test_a_new_schedule_is_a_new_builder():
    def backward_first_when_possible(n_stages, n_micro, stage_worker):
        # a valid but odd order: stage by stage, forward and backward per micro-batch
        # on the last stage, all forwards first elsewhere
        lists = S.gpipe(n_stages, n_micro, stage_worker)
        last = stage_worker[-1]
        lists[last] = [a for i in range(n_micro) for a in
                       (S.Action(S.FORWARD, n_stages - 1, i), S.Action(S.BACKWARD, n_stages - 1, i))]
        return lists
    lists = S.build(backward_first_when_possible, 2, 3, (0, 1))
    assert [str(a) for a in lists[1] if a.kind in "FB"] == ["F0.1", "B0.1", "F1.1", "B1.1",
                                                            "F2.1", "B2.1"]


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        S.build("zigzag", 2, 2, (0, 1))
    with pytest.raises(ValueError, match="one stage per placement"):
        S.build("1f1b", 4, 4, (0, 1, 0, 1))
    with pytest.raises(ValueError, match="k % 2"):
        S.build("interleaved_1f1b", 4, 4, (0, 0, 1, 1))
    with pytest.raises(ValueError, match="at least 1"):
        S.build("gpipe", 2, 0, (0, 1))

    def deadlocks(n_stages, n_micro, stage_worker):
        lists = S.gpipe(n_stages, n_micro, stage_worker)
        lists[0] = list(reversed(lists[0]))  # backward before its forward
        return lists
    with pytest.raises(ValueError, match="deadlocks"):
        S.build(deadlocks, 2, 2, (0, 1))

    def forgets(n_stages, n_micro, stage_worker):
        lists = S.gpipe(n_stages, n_micro, stage_worker)
        lists[1] = lists[1][1:]
        return lists
    with pytest.raises(ValueError, match="missing"):
        S.build(forgets, 2, 2, (0, 1))
