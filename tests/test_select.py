"""The selection layer: one package name, files from mine/, solutions/ or an explicit path."""

import subprocess
import sys

import pytest

from course.grader import select


def test_resolve_defaults_to_solutions():
    assert select.resolve("m03_sparse_moe", {"default": "solutions"}) == select.ROOT / "solutions" / "m03_sparse_moe.py"
    assert select.resolve("m03_sparse_moe", {"default": "solutions", "m03_sparse_moe": "mine"}) == \
        select.ROOT / "mine" / "m03_sparse_moe.py"


def test_missing_module_is_a_clear_import_error():
    with pytest.raises(ModuleNotFoundError, match="does not exist"):
        select.resolve("m99_nothing", {"default": "solutions"})


def _run(code: str, selection: dict) -> str:
    env_code = f"import os; os.environ[{select.ENV!r}] = {select.encode(selection)!r}\n" + code
    proc = subprocess.run([sys.executable, "-c", env_code], cwd=select.ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_relative_imports_between_exercise_files_follow_the_selection(tmp_path):
    (tmp_path / "a.py").write_text("WHO = 'a from tmp'\n")
    (tmp_path / "b.py").write_text("from .a import WHO\n")
    out = _run("from course.grader import select; select.install(); import impl.b; print(impl.b.WHO, impl.b.__file__)",
               {"default": "solutions", "a": str(tmp_path / "a.py"), "b": str(tmp_path / "b.py")})
    assert out.startswith("a from tmp") and out.endswith("b.py")


def test_the_same_module_name_serves_mine_and_solutions():
    code = ("from course.grader import select; m = select.load('m03_sparse_moe'); "
            "print(m.__name__, m.__file__)")
    assert _run(code, {"default": "solutions"}).endswith("solutions/m03_sparse_moe.py")
    assert _run(code, {"default": "solutions", "m03_sparse_moe": "mine"}).endswith("mine/m03_sparse_moe.py")


def test_a_failed_import_is_retried():
    code = ("from course.grader import select\n"
            "for _ in range(2):\n"
            "    try: select.load('m03_sparse_moe')\n"
            "    except SyntaxError: print('syntax')\n")
    import tempfile, pathlib
    with tempfile.TemporaryDirectory() as d:
        bad = pathlib.Path(d) / "bad.py"
        bad.write_text("def f(:\n")
        assert _run(code, {"default": "solutions", "m03_sparse_moe": str(bad)}).split() == ["syntax", "syntax"]


def test_use_loads_mine_for_the_named_exercises_and_solutions_for_the_rest():
    """`from course import use` in a notebook: the checker's selection, without touching the environment first."""
    code = ("import sys; sys.path.insert(0, '.')\n"
            "from course import use\n"
            "m05 = use('m05')\n"
            "import impl.m01_rmsnorm as m01\n"
            "print(m05.__file__, m01.__file__)\n"
            "a, b = use(mine=['m01', 'M05'])\n"
            "print(a.__file__, b.__file__)\n"
            "m06 = use('m06_models', mine='m01')\n"
            "print(m06.__file__, sys.modules['impl.m01_rmsnorm'].__file__, use('m02').__name__)\n"
            "try:\n    use('m99')\nexcept ValueError as exc:\n    print('error', 'm03' in str(exc))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=select.ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    folder = lambda path: path.split("/")[-2] + "/" + path.split("/")[-1]      # noqa: E731
    assert [folder(p) for p in lines[0]] == ["mine/m05_gated_deltanet.py", "solutions/m01_rmsnorm.py"]
    assert [folder(p) for p in lines[1]] == ["mine/m01_rmsnorm.py", "mine/m05_gated_deltanet.py"]
    assert [folder(p) for p in lines[2][:2]] == ["mine/m06_models.py", "mine/m01_rmsnorm.py"]
    assert lines[2][2] == "impl.m02_rope" and lines[3] == ["error", "True"]
