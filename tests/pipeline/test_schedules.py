"""Schedules as pure data: every micro-batch gets one F and one B per stage, dependencies hold when the
stages' lists are interleaved by a simulated clock, and 1F1B keeps within its activation bound."""

import pytest

from lightning_parallel.pipeline.schedules import (
    Action,
    async_step,
    bubble_fraction,
    cooldown,
    expected_bubbles,
    gpipe,
    max_in_flight,
    one_f_one_b,
    render,
    schedule,
    warmup_depth,
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
