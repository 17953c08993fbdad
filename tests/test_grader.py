"""The grader survives a broken learner file: syntax error, exception, infinite loop; and reports where.

A hang costs one check's limit, not one per check: the function that never returned is named, later checks
that call it report 超时 at once, and once a check has timed out the run ends at its deadline.
"""

import time

import pytest

from checks.timeouts import HungEarlier, _raiser
from course.grader import grade, registry
from course.grader.grade import run_checks

M03, E05 = registry.get("m03"), registry.get("e05")
ROUTE_TODO = 'raise NotImplementedError("m03: 请实现 route（见 lessons/m03_sparse_moe.md）")'
MOE_TODO = 'raise NotImplementedError("m03: 请实现 moe_forward（见 lessons/m03_sparse_moe.md）")'
GENERATE_TODO = 'raise NotImplementedError("e05: 请实现 LLM.generate（见 lessons/e05_engine.md）")'


def _grade_source(tmp_path, source: str, timeout: float | None = 30, ex=M03, **kwargs):
    path = tmp_path / f"{ex.module}.py"
    path.write_text(source, encoding="utf-8")
    return run_checks(ex, {"default": "solutions", ex.module: str(path)}, timeout_s=timeout, **kwargs)


def _stub(ex, todo: str, body: str, indent: str = "    ") -> str:
    return _plant(ex.stub.read_text(encoding="utf-8"), todo, body, indent)


def _plant(source: str, todo: str, body: str, indent: str = "    ") -> str:
    """The stub with one task's `raise NotImplementedError` replaced by `body`."""
    assert todo in source
    return source.replace(todo, body.replace("\n", "\n" + indent))


def _summary(g) -> str:
    return g.crash + "\n".join(f"{r['status']:8} {r['point']}: {r['message'][:200]} {r['where']}" for r in g.results)


def test_syntax_error_is_reported_per_check_with_its_line(tmp_path):
    g = _grade_source(tmp_path, "import torch\n\ndef route(x:\n")
    assert len(g.results) >= 5 and not g.crash
    for r in g.results:
        assert r["status"] == "error" and r["message"].startswith("SyntaxError"), r
        assert r["where"].endswith("m03_sparse_moe.py:3"), r


def test_exception_is_reported_with_file_and_line(tmp_path):
    g = _grade_source(tmp_path, _stub(M03, ROUTE_TODO, "x = 1\nraise ValueError('boom')"))
    route_checks = [r for r in g.results if "ValueError" in r["message"]]
    assert route_checks, g.results
    assert all(r["status"] == "error" and ":" in r["where"] for r in route_checks)
    assert any(r["status"] == "todo" for r in g.results)   # the other tasks are still 未实现


def test_infinite_loop_times_out_and_the_grader_goes_on(tmp_path):
    stub = M03.stub.read_text(encoding="utf-8")
    source = stub.replace('raise NotImplementedError("m03: 请实现 route（见 lessons/m03_sparse_moe.md）")',
                          "while True:\n        pass")
    grade = _grade_source(tmp_path, source, timeout=1)
    statuses = {r["status"] for r in grade.results}
    assert "timeout" in statuses and len(grade.results) == 10, grade.results


def test_a_check_skipped_for_want_of_a_gpu_neither_fails_nor_passes():
    from course.grader.grade import Grade
    row = lambda status: {"status": status}  # noqa: E731
    assert Grade(M03, [row("passed"), row("skipped")]).passed
    assert not Grade(M03, [row("skipped")]).passed                     # nothing actually passed
    assert not Grade(M03, [row("passed"), row("failed"), row("skipped")]).passed
    assert Grade(M03, [row("todo"), row("skipped")]).all_todo
    assert not Grade(M03, [row("skipped")]).all_todo


def test_a_hang_is_named_and_later_calls_are_not_waited_for(tmp_path):
    events = []
    g = _grade_source(tmp_path, _stub(M03, ROUTE_TODO, "while True:\n    pass"), timeout=2,
                      on_event=lambda kind, data: events.append((time.monotonic(), kind, data)))
    assert len(g.results) == 10 and not g.crash, _summary(g)
    timeouts = [r for r in g.results if r["status"] == "timeout"]
    assert len(timeouts) >= 3, _summary(g)
    first, later = timeouts[0], timeouts[1:]
    assert "超过 2 秒" in first["message"] and "route()" in first["message"], first
    assert "m03_sparse_moe.py:" in first["where"], first
    for r in later:
        assert "route()" in r["message"] and "前面的检查" in r["message"], r
    assert {r["status"] for r in g.results} == {"timeout", "todo"}, _summary(g)
    # progress: the plan first (with the limit), then one event per check, as it finished
    kinds = [k for _, k, _ in events]
    assert kinds == ["plan"] + ["result"] * 10 and events[0][2]["limit"] == 2
    after_first = [t for t, k, d in events if k == "result" and d is not first][-1] - \
        next(t for t, k, d in events if k == "result" and d["status"] == "timeout")
    assert after_first < 10, f"the checks after the hang took {after_first:.1f} s"


def test_a_hanging_stub_is_reported_within_a_minute_with_the_default_limit(tmp_path):
    g = _grade_source(tmp_path, _stub(M03, ROUTE_TODO, "while True:\n    pass"), timeout=None)
    assert g.seconds < 60, f"{g.seconds:.0f} s\n{_summary(g)}"
    assert g.limit == grade.CHECK_TIMEOUT_S <= 30
    timeouts = [r for r in g.results if r["status"] == "timeout"]
    assert timeouts and f"超过 {grade.CHECK_TIMEOUT_S} 秒" in timeouts[0]["message"], _summary(g)


def test_a_hanging_engine_is_reported_quickly(tmp_path):
    g = _grade_source(tmp_path, _stub(E05, GENERATE_TODO, "while True:\n    pass", indent="        "), ex=E05,
                      timeout=5)
    assert not g.crash and g.seconds < 60, f"{g.seconds:.0f} s\n{_summary(g)}"
    timeouts = [r for r in g.results if r["status"] == "timeout"]
    assert len(timeouts) >= 2 and "LLM.generate()" in timeouts[0]["message"], _summary(g)
    assert sum("超过 5 秒没有结束" in r["message"] for r in timeouts) == 1, _summary(g)


def test_after_a_timeout_nothing_runs_past_the_deadline(tmp_path):
    source = _plant(_stub(M03, ROUTE_TODO, "while True:\n    pass"), MOE_TODO, "while True:\n    pass")
    g = _grade_source(tmp_path, source, timeout=2, wall_s=1)
    statuses = [r["status"] for r in g.results]
    assert statuses[0] == "timeout" and set(statuses[1:]) == {"notrun"}, _summary(g)
    assert "未运行" in g.results[1]["message"]


def test_a_check_that_swallows_its_interrupt_is_killed(tmp_path):
    body = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass"
    g = _grade_source(tmp_path, _stub(M03, ROUTE_TODO, body), timeout=1)
    assert g.seconds < 60 and not g.crash, _summary(g)
    assert g.results[0]["status"] == "timeout" and "强制结束" in g.results[0]["message"], _summary(g)
    assert len(g.results) == 10 and {r["status"] for r in g.results[1:]} == {"notrun"}, _summary(g)


def test_a_disabled_function_raises_at_once_whatever_its_closure():
    class Base:
        def f(self):
            return 0

    k = 3

    class Child(Base):
        def f(self):                        # super() makes __class__ a free variable; k is another
            while True:
                super().f() + k

    code = Child.f.__code__
    Child.f.__code__ = _raiser(code.co_freevars, "hung", "here")
    with pytest.raises(HungEarlier, match="hung"):
        Child().f()


def test_a_triton_kernel_error_on_the_cpu_points_at_the_line_inside_the_kernel(tmp_path):
    """Under TRITON_INTERPRET=1 the interpreter raises at the launch; the failing line inside the @triton.jit
    function is the InterpreterError's cause, and that is the line the learner must see (and its error)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernel is compiled, not interpreted")
    k01 = registry.get("k01")
    anchor = "    dims = tl.arange(0, BLOCK_D)[None, :]                # [1, BLOCK_D]\n"
    source = k01.reference.read_text(encoding="utf-8")
    assert source.count(anchor) == 1
    source = source.replace(anchor, anchor + "    dims = tl.reshape(dims, (3, 5))\n")
    line = source[:source.index("tl.reshape(dims, (3, 5))")].count("\n") + 1
    path = tmp_path / f"{k01.module}.py"
    path.write_text(source, encoding="utf-8")
    g = run_checks(k01, {"default": "solutions", k01.module: str(path)}, ("-k", "test_store_kvcache_slots"), timeout_s=120)
    assert len(g.results) == 1 and g.results[0]["status"] == "error", _summary(g)
    r = g.results[0]
    assert r["where"].endswith(f"{k01.module}.py:{line}"), _summary(g)
    assert r["message"].startswith("ValueError") and "Triton 解释器" in r["message"], _summary(g)


def test_a_check_process_that_dies_midway_is_never_a_pass(tmp_path):
    """A segfault (here os._exit) inside one check: that check is an error, later ones did not run, no pass."""
    source = M03.reference.read_text(encoding="utf-8")
    source += "\n\ndef moe_forward(*args, **kwargs):\n    import os\n    os._exit(139)\n"
    g = _grade_source(tmp_path, source)
    assert not g.passed, _summary(g)
    died = [r for r in g.results if r["status"] == "error" and "退出码 139" in r["message"]]
    assert len(died) == 1, _summary(g)
    assert any(r["status"] == "passed" for r in g.results), _summary(g)       # the route checks ran before it
    assert all(r["status"] != "passed" for r in g.results[g.results.index(died[0]):]), _summary(g)


def test_events_split_inside_a_character_are_read_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    line = '{"event": "result", "message": "未实现"}\n'.encode("utf-8")
    events = grade._Events(path)
    path.write_bytes(line[:-8])                  # the write stopped inside a 3-byte character
    assert events.new() == []
    path.write_bytes(line)
    assert events.new() == [{"event": "result", "message": "未实现"}]


def test_stop_when_ends_the_run_at_the_failure_it_waits_for(tmp_path):
    """The selftest stops a plant's grading at the failure that settles it; the rest is 未运行, not a crash."""
    source = M03.reference.read_text(encoding="utf-8") + "\n\ndef route(*args, **kwargs):\n    raise ValueError('boom')\n"
    g = _grade_source(tmp_path, source, stop_when=lambda r: r["status"] == "error")
    assert not g.crash and not g.passed, _summary(g)
    first = next(i for i, r in enumerate(g.results) if r["status"] == "error")
    assert g.results[first + 1:] and all(r["status"] == "notrun" for r in g.results[first + 1:]), _summary(g)
