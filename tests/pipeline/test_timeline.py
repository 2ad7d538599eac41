from lightning_parallel.pipeline.timeline import Event, bubble, write_chrome_trace, write_svg


def test_bubble_is_idle_share_and_files_are_written(tmp_path):
    events = [Event(0, "F", 0, 0.0, 1.0), Event(0, "wait", 1, 1.0, 2.0), Event(0, "B", 0, 2.0, 4.0)]
    assert abs(bubble(events) - 0.25) < 1e-12
    trace = write_chrome_trace(events, tmp_path / "t.json").read_text()
    assert '"ph": "X"' in trace and '"name": "B0"' in trace
    svg = write_svg(events, tmp_path / "t.svg", "test").read_text()
    assert svg.startswith("<svg") and "rank 0" in svg and "B0" in svg


def test_a_carried_backward_is_marked_and_survives_the_gather(tmp_path):
    from lightning_parallel.pipeline.timeline import from_dicts, to_dicts

    events = from_dicts(to_dicts([Event(0, "B", 3, 0.0, 1.0, previous=True), Event(0, "F", 0, 1.0, 2.0)]))
    assert [e.label for e in events] == ["B3'", "F0"]
    assert "B3'" in write_svg(events, tmp_path / "t.svg", "async").read_text()
    assert '"name": "B3\'"' in write_chrome_trace(events, tmp_path / "t.json").read_text()
