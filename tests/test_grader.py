"""The grader survives a broken learner file: syntax error, exception, infinite loop; and reports where."""

from course import registry
from course.grade import run_checks

M03 = registry.get("m03")


def _grade_source(tmp_path, source: str, timeout: int = 30):
    path = tmp_path / "m03_sparse_moe.py"
    path.write_text(source, encoding="utf-8")
    return run_checks(M03, {"default": "solutions", M03.module: str(path)}, timeout_s=timeout)


def test_syntax_error_is_reported_per_check_with_its_line(tmp_path):
    grade = _grade_source(tmp_path, "import torch\n\ndef route(x:\n")
    assert len(grade.results) >= 5 and not grade.crash
    for r in grade.results:
        assert r["status"] == "error" and r["message"].startswith("SyntaxError"), r
        assert r["where"].endswith("m03_sparse_moe.py:3"), r


def test_exception_is_reported_with_file_and_line(tmp_path):
    stub = M03.stub.read_text(encoding="utf-8")
    source = stub.replace('raise NotImplementedError("m03: 请实现 route（见 lessons/m03_sparse_moe.md）")',
                          "x = 1\n    raise ValueError('boom')")
    grade = _grade_source(tmp_path, source)
    route_checks = [r for r in grade.results if "ValueError" in r["message"]]
    assert route_checks, grade.results
    assert all(r["status"] == "error" and ":" in r["where"] for r in route_checks)
    assert any(r["status"] == "todo" for r in grade.results)   # the other tasks are still 未实现


def test_infinite_loop_times_out_and_the_grader_goes_on(tmp_path):
    stub = M03.stub.read_text(encoding="utf-8")
    source = stub.replace('raise NotImplementedError("m03: 请实现 route（见 lessons/m03_sparse_moe.md）")',
                          "while True:\n        pass")
    grade = _grade_source(tmp_path, source, timeout=1)
    statuses = {r["status"] for r in grade.results}
    assert "timeout" in statuses and len(grade.results) == 10, grade.results


def test_a_check_skipped_for_want_of_a_gpu_neither_fails_nor_passes():
    from course.grade import Grade
    row = lambda status: {"status": status}  # noqa: E731
    assert Grade(M03, [row("passed"), row("skipped")]).passed
    assert not Grade(M03, [row("skipped")]).passed                     # nothing actually passed
    assert not Grade(M03, [row("passed"), row("failed"), row("skipped")]).passed
    assert Grade(M03, [row("todo"), row("skipped")]).all_todo
    assert not Grade(M03, [row("skipped")]).all_todo
