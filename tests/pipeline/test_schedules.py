"""Schedules as pure data: every micro-batch gets one F and one B (or I and W) per stage and chunk,
dependencies hold when the stages' lists are interleaved by a simulated clock, the bubbles match their
theory, and each schedule keeps within its activation bound."""

import pytest

from lightning_parallel.pipeline import schedules
from lightning_parallel.pipeline.clock import ScheduleError, check_plans
from lightning_parallel.pipeline.clock import run_clock as run_timed
from lightning_parallel.pipeline.schedules import (
    Action,
    activation_bound,
    async_step,
    bubble_fraction,
    chunks_per_rank,
    cooldown,
    expected_bubbles,
    forward_only,
    gpipe,
    max_in_flight,
    one_f_one_b,
    render,
    schedule,
    schedule_problem,
    verify_schedule,
    virtual_stages_problem,
    warmup_depth,
    zb_h1_bubble_fraction,
)


def simulate(name: str, stages: int, m: int) -> list[list[str]]:
    return run_clock([schedule(name, stages, m, s) for s in range(stages)], name)


def async_stream(stages: int, m: int, batches: int) -> list[list[Action]]:
    """Each stage's actions over ``batches`` async steps, from an empty pipeline to the final cool-down,
    with micro-batch numbers made global (batch * m + i) so the stream can be checked as one."""
    streams = []
    for s in range(stages):
        actions, carried = [], 0
        for b in range(batches):
            actions += [
                Action(a.kind, (b + a.batch) * m + a.microbatch) for a in async_step(stages, m, s, carried)
            ]
            carried = warmup_depth(stages, m, s)
        actions += [Action(a.kind, (batches - 1) * m + a.microbatch) for a in cooldown(stages, m, s)]
        streams.append(actions)
    return streams


def run_clock(lists: list[list[Action]], name: str = "") -> list[list[str]]:
    """Run all stages' action lists against each other with unit-time actions; returns the clock table.
    An F needs the previous stage's F of that micro-batch done; a B the next stage's B (or, on the last
    stage, its own F). Raises if the schedules deadlock."""
    stages = len(lists)
    done: set[tuple[str, int, int]] = set()
    clock: list[list[str]] = []
    while any(lists):
        row = []
        ready_now = set()
        for s, actions in enumerate(lists):
            if not actions:
                row.append("..")
                continue
            a = actions[0]
            dep = (
                (("F", s - 1, a.microbatch) if s > 0 else None)
                if a.kind == "F"
                else (("B", s + 1, a.microbatch) if s < stages - 1 else ("F", s, a.microbatch))
            )
            if dep is None or dep in done:
                ready_now.add((a.kind, s, a.microbatch))
                actions.pop(0)
                row.append(str(a))
            else:
                row.append("..")
        if not ready_now:
            raise AssertionError(f"deadlock in {name}: {lists}")
        done |= ready_now
        clock.append(row)
    return clock


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(2, 4), (2, 8), (3, 4), (4, 4), (4, 8), (1, 3)])
def test_one_forward_and_one_backward_per_microbatch(name, stages, m):
    for s in range(stages):
        actions = schedule(name, stages, m, s)
        assert sorted(str(a) for a in actions if a.kind == "F") == sorted(f"F{i}" for i in range(m))
        assert sorted(str(a) for a in actions if a.kind == "B") == sorted(f"B{i}" for i in range(m))
        seen_f = set()
        for a in actions:  # on a stage, a micro-batch's backward comes after its forward
            if a.kind == "F":
                seen_f.add(a.microbatch)
            else:
                assert a.microbatch in seen_f


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(2, 4), (3, 4), (4, 8)])
def test_stages_run_against_each_other_without_deadlock_in_the_ideal_time(name, stages, m):
    clock = simulate(name, stages, m)
    assert len(clock) == 2 * (m + stages - 1)  # fill + drain: the bubble of (p-1)/(m+p-1)
    idle = sum(cell == ".." for row in clock for cell in row) / (len(clock) * stages)
    assert abs(idle - bubble_fraction(stages, m)) < 1e-12


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,m", [(2, 4), (2, 8), (3, 4), (4, 8)])
def test_expected_bubbles_of_equal_stages_is_the_formula_on_stage_0(name, stages, m):
    bubbles = expected_bubbles(name, stages, m, [1.0] * stages, [2.0] * stages)
    assert abs(bubbles[0] - bubble_fraction(stages, m)) < 1e-12
    assert all(b < bubbles[0] for b in bubbles[1:])  # later stages end before the first one's last B


def test_expected_bubbles_of_a_slower_last_stage():
    # gpipe, 2 stages, 2 micro-batches; stage 1 twice as slow. Stage 0: F0 0-1, F1 1-2, waits for stage 1
    # (F0 1-3, F1 3-5, B0 5-7, B1 7-9), then B0 7-8 and B1 9-10: 4 busy of 10. Stage 1: 8 busy of 9.
    assert expected_bubbles("gpipe", 2, 2, [1.0, 2.0], [1.0, 2.0]) == pytest.approx([0.6, 1 / 9])
    for name in ("gpipe", "1f1b"):
        assert expected_bubbles(name, 2, 4, [1.0, 1.3], [2.0, 2.6])[0] > bubble_fraction(2, 4)


@pytest.mark.parametrize("stages,m", [(2, 4), (3, 6), (4, 8), (4, 4)])
def test_1f1b_holds_at_most_stages_minus_stage_activations(stages, m):
    for s in range(stages):
        assert max_in_flight(one_f_one_b(stages, m, s)) <= stages - s
        assert max_in_flight(gpipe(stages, m, s)) == m  # gpipe holds every micro-batch


def test_render_and_errors():
    assert render("1f1b", 2, 2) == "stage 0: F0 F1 B0 B1\nstage 1: F0 B0 F1 B1"
    with pytest.raises(ValueError, match="schedule='zero' is not known"):
        schedule("zero", 2, 4, 0)
    with pytest.raises(ValueError, match="bad schedule shape"):
        gpipe(2, 4, 2)


@pytest.mark.parametrize("stages,m", [(2, 4), (3, 4), (4, 8), (4, 3), (2, 1)])
def test_async_steps_join_into_one_1f1b_stream_with_no_flush(stages, m):
    batches = 5
    streams = async_stream(stages, m, batches)
    for s, actions in enumerate(streams):
        n = batches * m
        assert sorted(a.microbatch for a in actions if a.kind == "F") == list(range(n))
        assert sorted(a.microbatch for a in actions if a.kind == "B") == list(range(n))
        assert max_in_flight(actions) <= stages - s
        # it is exactly the continuous 1F1B stream over all batches' micro-batches
        assert actions == one_f_one_b(stages, n, s)
    clock = run_clock(streams, "async")
    # one fill and one drain for all batches, instead of one per batch: (p-1)/(n+p-1) idle
    assert len(clock) == 2 * (batches * m + stages - 1)


def test_async_step_marks_the_previous_batch_and_checks_what_it_carries():
    assert " ".join(map(str, async_step(2, 4, 0, carried=1))) == "F0 B3' F1 B0 F2 B1 F3 B2"
    assert " ".join(map(str, async_step(2, 4, 0, carried=0))) == "F0 F1 B0 F2 B1 F3 B2"
    assert " ".join(map(str, cooldown(2, 4, 0, batch=-1))) == "B3'"
    assert cooldown(2, 4, 1) == []  # the last stage never carries anything over
    with pytest.raises(ValueError, match="can carry 0..1 micro-batches over, not 2"):
        async_step(2, 4, 0, carried=2)


def chunk_stream(p: int, m: int, v: int, batches: int) -> list[list[Action]]:
    """``async_stream`` with ``v`` looping chunks: each rank's async steps over ``batches`` batches and the
    final cool-down, micro-batches numbered globally."""
    streams = []
    for r in range(p):
        actions, carried = [], 0
        for b in range(batches):
            step = async_step(p, m, r, carried, v)
            actions += [Action(a.kind, (b + a.batch) * m + a.microbatch, chunk=a.chunk) for a in step]
            carried = warmup_depth(p, m, r, v)
        last = (batches - 1) * m
        actions += [Action(a.kind, last + a.microbatch, chunk=a.chunk) for a in cooldown(p, m, r, 0, v)]
        streams.append(actions)
    return streams


TWO_VERSIONS = [
    (2, 2, 2),
    (2, 4, 2),
    (2, 4, 3),
    (2, 3, 2),
    (3, 4, 2),
    (3, 6, 2),
    (4, 6, 2),
    (4, 8, 2),
    (4, 8, 3),
]


@pytest.mark.parametrize("p,m,v", TWO_VERSIONS)
def test_async_steps_with_looping_chunks_join_into_interleaved_1f1b_with_two_versions(p, m, v):
    """Each async step runs only its own batch's forwards and the backwards of its batch and the one
    before (two weight versions); the steps run against each other without deadlock, messages in order,
    idle only in one fill and drain however many steps; with m a multiple of p they are Megatron's
    interleaved 1F1B over all batches' micro-batches."""
    batches = 4
    assert schedule_problem("async", p, m, v) is None
    streams = chunk_stream(p, m, v, batches)
    check_plans("async", streams, batches * m, v)
    for r in range(p):
        for carried in (0, warmup_depth(p, m, r, v)):
            step = async_step(p, m, r, carried, v)
            assert {a.batch for a in step if a.kind == "F"} == {0}
            assert sorted((a.microbatch, a.chunk) for a in step if a.kind == "F") == [
                (i, c) for i in range(m) for c in range(v)
            ]
            assert sum(a.batch == -1 for a in step) == carried  # everything the previous batch left
        assert schedule("async", p, m, r, v) == schedules.interleaved_1f1b(p, m, r, v)
        if m % p == 0:
            assert streams[r] == schedules.interleaved_1f1b(p, batches * m, r, v)

    def idle(n: int) -> float:  # on the clock, unit actions: the end of the last rank less its work
        times = run_timed("async", chunk_stream(p, m, v, n), v, lambda r, a: 1.0)
        return max(t[-1][1] for t in times) - 2 * m * v * n

    assert idle(batches) == idle(2 * batches) == 2 * (p - 1)  # one fill and drain, however many steps


@pytest.mark.parametrize("p,m,v", [(3, 3, 2), (4, 4, 2), (4, 4, 3), (2, 1, 2), (3, 2, 2)])
def test_async_with_looping_chunks_needing_a_third_version_is_refused_with_the_reason(p, m, v):
    problem = schedule_problem("async", p, m, v)
    assert "third weight version" in problem and f"num_microbatches={m}" in problem
    with pytest.raises(ValueError, match="third weight version"):
        async_step(p, m, 0, 0, v)
    if m % p == 0:  # the argument: in the no-flush interleaved stream (rounds of p, as Megatron's), rank 0
        # runs a backward of batch t after its first forward of batch t + 2
        actions = schedules.interleaved_1f1b(p, 4 * m, 0, v)
        first = {}
        for k, a in enumerate(actions):
            if a.kind == "F":
                first.setdefault(a.microbatch // m, k)
        assert any(
            a.kind == "B" and k > first[a.microbatch // m + 2] for k, a in enumerate(actions[: first[3]])
        )


def test_the_third_version_refusal_names_what_works():
    problem = schedule_problem("async", 4, 4, 2)
    assert "rank 0 runs 10 chunk forwards ahead" in problem and "4 x 2 = 8" in problem
    assert "num_microbatches >= 6" in problem and "virtual_stages=1" in problem
    assert schedule_problem("async", 4, 6, 2) is None and schedule_problem("async", 4, 5, 2) is not None
    assert "schedule='async' runs the micro-batches in equal rounds" in schedule_problem("async", 4, 9, 2)
    assert virtual_stages_problem("async", 3) is None and virtual_stages_problem("async", 0) is not None


# ----------------------------------------------------------------- chunks and split backwards
NEW = [("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)]
SHAPES = [(2, 4), (2, 8), (4, 4), (4, 8)]
ODD = [(2, 3), (4, 5), (4, 6), (4, 10), (4, 2), (3, 4), (3, 5), (1, 3)]  # accepted by all three


@pytest.mark.parametrize("name,v", NEW + [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 3)])
@pytest.mark.parametrize("p,m", SHAPES + ODD)
def test_every_schedule_passes_the_clock_check(name, p, m, v):
    verify_schedule(name, p, m, v)


@pytest.mark.parametrize("name,v", NEW)
@pytest.mark.parametrize("p,m", SHAPES + ODD)
def test_each_rank_does_each_chunks_work_once(name, p, m, v):
    for r in range(p):
        actions = schedule(name, p, m, r, v)
        split = name != "interleaved_1f1b"
        absent = "B" if split else "IW"
        for c in range(v):
            for kind in "FBIW":
                got = sorted(a.microbatch for a in actions if a.chunk == c and a.kind == kind)
                assert got == ([] if kind in absent else list(range(m))), (r, c, kind)
        assert len(actions) == m * v * (3 if split else 2)


def test_small_schedules_exactly():
    assert render("interleaved_1f1b", 2, 4, 2) == (
        "rank 0: F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3\n"
        "rank 1: F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"
    )
    assert render("zb_h1", 2, 4) == (
        "stage 0: F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3\nstage 1: F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3"
    )
    assert render("zbv", 2, 4, 2) == (
        "rank 0: F0 F1 F2 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F3 I0 W0 F2.1 I2.1 W2.1 I1 W1 F3.1 I3.1 W3.1 I2 W2 I3 W3\n"
        "rank 1: F0 F0.1 F1 F1.1 I0.1 W0.1 F2 I0 W0 F2.1 I1.1 W1.1 F3 I1 W1 F3.1 I2.1 W2.1 I2 I3.1 I3 W2 W3.1 W3"
    )


def test_the_old_schedules_print_as_before():
    assert render("gpipe", 2, 3) == "stage 0: F0 F1 F2 B0 B1 B2\nstage 1: F0 F1 F2 B0 B1 B2"
    assert render("1f1b", 3, 4) == (
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3\nstage 1: F0 F1 B0 F2 B1 F3 B2 B3\nstage 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )
    assert str(Action("B", 3, -1)) == "B3'" and str(Action("F", 3, chunk=1)) == "F3.1"
    assert str(Action("B", 2, -1, chunk=1)) == "B2.1'"


def test_the_docstring_pictures_are_the_clock_s():
    for name, p, m, v in [
        ("gpipe", 3, 4, 1),
        ("1f1b", 3, 4, 1),
        ("interleaved_1f1b", 2, 4, 2),
        ("zb_h1", 3, 4, 1),
    ]:
        for line in render(name, p, m, v, timed=True).splitlines():
            assert line in schedules.__doc__, (name, line)


@pytest.mark.parametrize("p,m", SHAPES)
def test_interleaved_bubble_is_megatron_s_and_below_1f1b_s(p, m):
    v = 2
    # each chunk half a stage: F 1 and B 2 per stage, as for 1F1B
    bubbles = expected_bubbles(
        "interleaved_1f1b", p, m, [1 / v] * (p * v), [2 / v] * (p * v), virtual_stages=v
    )
    assert bubbles[0] == pytest.approx(bubble_fraction(p, m, v))
    # (p - 1) / (v m) of the busy time, Megatron's form
    assert bubbles[0] / (1 - bubbles[0]) == pytest.approx((p - 1) / (v * m))
    assert bubbles[0] < expected_bubbles("1f1b", p, m, [1.0] * p, [2.0] * p)[0]


def test_zb_h1_halves_1f1b_s_bubble_at_two_stages_and_four_microbatches():
    f, i, w = 1.0, 1.0, 1.0
    zb = expected_bubbles("zb_h1", 2, 4, [f] * 2, [i + w] * 2, [w] * 2)
    one = expected_bubbles("1f1b", 2, 4, [f] * 2, [i + w] * 2)
    assert zb[0] <= one[0] / 2
    # 1 idle unit (F + I - W) against 1F1B's 3 (F + I + W), over 12 busy
    assert zb[0] == pytest.approx(1 / 13) and one[0] == pytest.approx(3 / 15)


@pytest.mark.parametrize("p,m", SHAPES + [(3, 3), (4, 5)])
@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 1.0), (2.0, 1.0, 0.5), (1.0, 2.0, 1.0)])
def test_zb_h1_bubble_is_the_papers(p, m, f, i, w):
    bubbles = expected_bubbles("zb_h1", p, m, [f] * p, [i + w] * p, [w] * p)
    assert bubbles[0] == pytest.approx(zb_h1_bubble_fraction(p, m, f, i, w))


@pytest.mark.parametrize("p,m", SHAPES)
def test_zbv_bubble_is_below_1f1b_s_and_none_on_rank_0_with_equal_costs(p, m):
    # F = I = W = 1 per chunk: F 2 and B 4 per whole stage for 1F1B
    bubbles = expected_bubbles("zbv", p, m, [1.0] * (2 * p), [2.0] * (2 * p), virtual_stages=2)
    assert max(bubbles) < expected_bubbles("1f1b", p, m, [2.0] * p, [4.0] * p)[0]
    if m >= 2 * p:  # enough micro-batches to fill the V
        assert bubbles[0] == pytest.approx(0.0)


@pytest.mark.parametrize("name,v", NEW + [("gpipe", 1), ("1f1b", 1)])
@pytest.mark.parametrize("p,m", SHAPES + ODD)
def test_activations_stay_within_each_schedule_s_bound(name, v, p, m):
    for r in range(p):
        held = max_in_flight(schedule(name, p, m, r, v))
        assert held <= activation_bound(name, p, m, r, v)
        if name != "zbv" or m >= 2 * p - 1:  # zbv with fewer micro-batches than its V holds fewer
            assert held == activation_bound(name, p, m, r, v)
        if name in ("zb_h1", "zbv"):
            # in whole stages (a chunk is 1/v of one): never more than 1F1B's peak, its stage 0
            assert held / v <= activation_bound("1f1b", p, m, 0)


def test_interleaved_holds_megatron_s_factor_more_on_stage_0():
    p, m, v = 4, 8, 2
    held = max_in_flight(schedule("interleaved_1f1b", p, m, 0, v)) / v  # in whole stages
    assert held == p * (1 + (p - 1) / (p * v))


def test_refused_combinations_name_what_works():
    with pytest.raises(
        ValueError, match=r"virtual_stages=1 with schedule='interleaved_1f1b': .* >= 2 .*'1f1b'"
    ):
        schedule("interleaved_1f1b", 2, 4, 0, 1)
    with pytest.raises(
        ValueError, match=r"below 8 or a multiple of num_microbatches // 4; got 9: use 8 or 10"
    ):
        schedule("interleaved_1f1b", 4, 9, 0, 2)
    with pytest.raises(ValueError, match=r"virtual_stages=3 with schedule='zbv': it places exactly 2 chunks"):
        schedule("zbv", 2, 4, 0, 3)
    for name in ("gpipe", "1f1b", "zb_h1"):
        with pytest.raises(
            ValueError, match=rf"schedule='{name}', which runs one chunk per rank.*'interleaved_1f1b'"
        ):
            schedule(name, 2, 4, 0, 2)
    with pytest.raises(ValueError, match="one forward, backward and weight cost per virtual stage"):
        expected_bubbles("zbv", 2, 4, [1.0] * 2, [2.0] * 2, virtual_stages=2)


def test_the_strategy_s_questions_about_chunks():
    assert chunks_per_rank("async", 2) == 2
    assert [chunks_per_rank(n) for n in ("gpipe", "1f1b", "async", "interleaved_1f1b", "zb_h1", "zbv")] == [
        1,
        1,
        1,
        2,
        1,
        2,
    ]
    assert chunks_per_rank("interleaved_1f1b", 3) == 3
    assert virtual_stages_problem("interleaved_1f1b", None) is None  # the schedule's own
    assert virtual_stages_problem("zbv", 2) is None and virtual_stages_problem("gpipe", 1) is None
    assert virtual_stages_problem("1f1b", 2, "strategy.").startswith(
        "strategy.virtual_stages=2 with schedule='1f1b'"
    )
    assert virtual_stages_problem("interleaved_1f1b", True) is not None
    assert schedule_problem("interleaved_1f1b", 4, 8, 2) is None
    assert "got 9: use 8 or 10" in schedule_problem("interleaved_1f1b", 4, 9, 2)
    assert "is not known" in schedule_problem("zero", 4, 8, 1)


@pytest.mark.parametrize("name,v", NEW + [("gpipe", 1), ("interleaved_1f1b", 3)])
def test_evaluation_forwards_run_without_deadlock(name, v):
    p, m = 4, 5
    plans = [forward_only(name, p, m, r, v) for r in range(p)]
    assert all(
        sorted((a.chunk, a.microbatch) for a in plan) == [(c, i) for c in range(v) for i in range(m)]
        for plan in plans
    )
    run_timed(name, plans, v, lambda r, a: 1.0)


def test_the_check_catches_broken_schedules():
    good = [schedule("zb_h1", 2, 2, r) for r in range(2)]
    check_plans("zb_h1", good, 2, 1)
    with pytest.raises(ScheduleError, match="rank 1 does not do one F and one B"):
        check_plans("zb_h1", [good[0], [a for a in good[1] if str(a) != "W1"]], 2, 1)
    early = [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]  # a backward before its input
    with pytest.raises(
        ScheduleError,
        match="deadlocks: rank 0 at B0 waits for F0 of rank 0 chunk 0, B0 of rank 1 chunk 0; "
        "rank 1 at F0 waits for F0 of rank 0 chunk 0",
    ):
        check_plans("1f1b", [early, one_f_one_b(2, 2, 1)], 2, 1)
    swapped = [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]
    with pytest.raises(ScheduleError, match=r"rank 1 chunk 0 takes its F inputs in the order \[1, 0\]"):
        check_plans("gpipe", [gpipe(2, 2, 0), swapped], 2, 1)


def test_schedule_problem_is_the_one_shape_check():
    """Every refusal of a schedule's shape comes from ``schedule_problem``, 1F1B's micro-batch count too."""
    assert "needs num_microbatches >= the number of stages (4), got 2" in schedule_problem("1f1b", 4, 2)
    assert schedule_problem("1f1b", 4, 4) is None and schedule_problem("gpipe", 4, 2) is None
    assert "virtual_stages=3 with schedule='zbv'" in schedule_problem("zbv", 2, 4, 3)
