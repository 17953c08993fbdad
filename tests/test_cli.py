"""The CLI as the learner types it: exit codes, hints, the card, progress, reset."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from course.grader import select

ROOT = select.ROOT


def cli(*args, cwd=ROOT, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "course", *args], cwd=cwd, capture_output=True, text=True, env=env)


@pytest.fixture
def state_dir(tmp_path):
    return {"COURSE_STATE_DIR": str(tmp_path / "state")}


def test_overview_lists_every_track_and_the_next_exercise(state_dir):
    out = cli(env_extra=state_dir)
    assert out.returncode == 0, out.stderr
    from course.grader import registry
    coming = ["即将推出"] if any(not e.written for e in registry.CATALOGUE) else []
    for word in ("Track M", "Track E", "Track K", "Track G", "m03", "g01", "下一个练习", *coming):
        assert word in out.stdout, word


def test_unknown_exercise_exits_2_and_names_the_known_ones():
    out = cli("m99")
    assert out.returncode == 2 and "m03" in out.stdout


def test_unwritten_exercise_exits_2():
    from course.grader import registry
    coming = [e for e in registry.CATALOGUE if not e.written]
    if not coming:
        pytest.skip("every exercise of the catalogue is written")
    out = cli(coming[0].id)
    assert out.returncode == 2 and "即将推出" in out.stdout


@pytest.mark.parametrize("level,fragment", [(1, "关键问题"), (2, "repeat_interleave"), (3, "形状追踪")])
def test_hint_levels(level, fragment):
    out = cli("hint", "m03", "--level", str(level))
    assert out.returncode == 0 and fragment in out.stdout, out.stdout


def test_hint_without_exercise_is_a_usage_error():
    assert cli("hint").returncode == 2


def test_show_renders_the_card():
    out = cli("show", "m03")
    assert out.returncode == 0
    for section in ("题面速览", "易错点", "逐步图", "L1", "面试官追问"):
        assert section in out.stdout, section


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", ["gpu", "bench"])
def test_gpu_commands_need_a_gpu(command):
    out = cli(command)
    assert out.returncode == 2 and "需要 NVIDIA GPU" in out.stdout, out.stdout + out.stderr


def test_kernel_bench_without_cuda_needs_a_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: ./check.sh bench k01 would run the benchmark")
    out = cli("bench", "k01")
    assert out.returncode == 1 and "需要 GPU" in out.stdout, out.stdout + out.stderr


HINT_BODIES = {1: "I/O 示例 + 关键问题", 2: "思路拆分与常见坑", 3: "详解：答案、逐步追踪"}   # m03's L1/L2/L3 openings


@pytest.mark.parametrize("level", [0, 2])
def test_show_folds_the_hints_deeper_than_asked(level):
    out = cli("show", "m03", *(["--level", str(level)] if level else []))
    assert out.returncode == 0, out.stdout
    text = " ".join(out.stdout.split())             # rich wraps long lines
    for n, body in HINT_BODIES.items():
        assert (body in text) == (n <= level), f"L{n} {'hidden' if n <= level else 'shown'} at --level {level}"
        if n > level:
            assert f"./check.sh hint m03 --level {n}" in text, f"no line says how to open L{n}"


@pytest.mark.parametrize("args,fragment", [
    (["m03", "extra"], "多余的参数 'extra'"),
    (["show", "m03", "--bogus"], "不认识的选项 --bogus"),
    (["show", "m03", "m04"], "多余的参数 'm04'"),
    (["hint", "m03", "--level", "4"], "--level 只能是 1、2、3"),
    (["hint", "m03", "--level"], "--level 需要一个值"),
    (["m03", "--level", "2"], "不认识的选项 --level"),
    (["all", "m03"], "多余的参数 'm03'"),
    (["reset", "m03", "--solutions"], "这个命令没有选项"),
    (["show"], "缺少练习编号"),
])
def test_unexpected_arguments_are_errors(args, fragment):
    out = cli(*args)
    assert out.returncode == 2, out.stdout
    assert fragment in out.stdout and "用法：./check.sh" in out.stdout, out.stdout


def test_run_rejects_unknown_arguments():
    out = cli("run", "--bogus")
    assert out.returncode == 2 and "不认识的参数 --bogus" in out.stderr, out.stderr


@pytest.mark.parametrize("command", ["run", "serve"])
def test_run_and_serve_device_options_say_what_is_wrong(command):
    # in-process: each refusal happens after argument parsing, before an engine module is loaded
    import importlib
    main = importlib.import_module(f"course.runtime.{command}").main
    said = []

    def say(*args, **kwargs):
        said.append(str(args[0]) if args else "")
    assert main(["--gpu-memory-gib", "8"], say) == 2                              # a cap for the CPU engine
    assert "--gpu-memory-gib N 只用于 GPU 引擎：请同时加 --device cuda" in said[-1], said
    assert main(["--device", "cuda", "--gpu-memory-gib", "0"], say) == 2
    assert "N 要是正数" in said[-1], said
    import torch
    if not torch.cuda.is_available():
        assert main(["--device", "cuda"], say) == 2 and "--device cuda 需要 NVIDIA GPU" in said[-1], said


def test_a_refused_memory_plan_is_one_red_paragraph_and_no_engine():
    from course.runtime import device
    from course.runtime.memory import MemoryPlanError
    said = []

    def refuse():
        raise MemoryPlanError("显存放不下：权重 29.0 GiB > 预算 24.0 GiB")
    assert device.build(refuse, lambda *a, **k: said.append(a[0])) is None
    assert said == ["[red]显存放不下：权重 29.0 GiB > 预算 24.0 GiB[/]"]


def test_run_generates_offline_and_names_the_files(state_dir):
    out = cli("run", "--prompt", "你好", "--max-tokens", "5", env_extra=state_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    for fragment in ("solutions/m06_models.py", "solutions/e05_engine.py", "5 tokens"):
        assert fragment in out.stdout, fragment


def _copy_repo(tmp_path):
    dst = tmp_path / "repo"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".venv", ".git", ".course", "__pycache__", ".dev"))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(cmd, cwd=dst, check=True)
    return dst


def test_passing_mine_is_recorded_and_reset_restores_the_stub(tmp_path, state_dir):
    repo = _copy_repo(tmp_path)
    stub = (repo / "mine" / "m03_sparse_moe.py").read_text()
    shutil.copy(repo / "solutions" / "m03_sparse_moe.py", repo / "mine" / "m03_sparse_moe.py")
    out = cli("m03", cwd=repo, env_extra=state_dir)
    assert out.returncode == 0, out.stdout
    assert "solutions/m03_sparse_moe.py" in out.stdout and "下一个练习" in out.stdout
    assert "10 个检查，每个检查最多 20 秒" in out.stdout, out.stdout
    overview = cli(cwd=repo, env_extra=state_dir)
    assert "m03" in overview.stdout and "✓ 通过" in overview.stdout
    out = cli("reset", "m03", cwd=repo, env_extra=state_dir)
    assert out.returncode == 0, out.stdout
    assert (repo / "mine" / "m03_sparse_moe.py").read_text() == stub
    backups = list((repo / "mine" / ".backup").glob("m03_sparse_moe.*.py"))
    assert len(backups) == 1 and "index_add_" in backups[0].read_text()
    stub_out = cli("m03", cwd=repo, env_extra=state_dir)
    assert stub_out.returncode == 1 and "未实现" in stub_out.stdout


def test_run_with_a_model_folder_uses_its_tokenizer_and_chat_template(tmp_path, state_dir):
    code = ("import sys; sys.path.insert(0, '.')\n"
            "from course.runtime.tiny_tokenizer import byte_tokenizer\n"
            "from course.runtime.run import tiny_dummy_config\n"
            "from transformers import Qwen3ForCausalLM\n"
            "tok = byte_tokenizer(); m = Qwen3ForCausalLM(tiny_dummy_config(len(tok)))\n"
            f"m.save_pretrained({str(tmp_path)!r}); tok.save_pretrained({str(tmp_path)!r})\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    out = cli("run", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "4", env_extra=state_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "qwen3" in out.stdout and "4 tokens" in out.stdout
    # "hi" alone is 2 byte tokens; the chat template wraps it in <|im_start|>user ... <|im_start|>assistant
    assert "prompt（2 tokens）" not in out.stdout, "the chat template was not applied"


def test_check_sh_uses_a_ready_python_without_creating_a_venv(tmp_path):
    """A machine whose python3 already has everything (a GPU box, no network): no .venv is created."""
    repo = _copy_repo(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_USE_VENV", "COURSE_PYTHON")}
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"     # python3 = this ready interpreter
    out = subprocess.run(["bash", "check.sh", "hint", "m03", "--level", "1"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "关键问题" in out.stdout
    assert not (repo / ".venv").exists(), "check.sh created .venv although python3 already had every dependency"


def test_check_sh_honours_course_python(tmp_path):
    repo = _copy_repo(tmp_path)
    env = dict(os.environ, COURSE_PYTHON=sys.executable)
    out = subprocess.run(["bash", "check.sh", "m99"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "m03" in out.stdout, out.stdout + out.stderr
    assert not (repo / ".venv").exists()


def test_watch_grades_once_then_keeps_watching(state_dir):
    proc = subprocess.Popen([sys.executable, "-m", "course", "watch", "m03", "--solutions"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, **state_dir))
    try:
        seen = ""
        for line in proc.stdout:
            seen += line
            if "项通过" in line:
                break
        assert "监视 solutions/m03_sparse_moe.py" in seen and "全部" in seen, seen
        assert proc.poll() is None, "watch exited after the first grade instead of watching"
    finally:
        proc.kill()
        proc.wait()


def _processes_with(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_ctrl_c_exits_130_quietly_and_kills_the_checks(state_dir):
    mark = uuid.uuid4().hex
    # SIGINT back to its default in the child: a test run started in the background (`cmd &` in a script) inherits
    # SIGINT ignored, and a Python started that way never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-m", "course", "m03", "--solutions"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            env=dict(os.environ, COURSE_TEST_MARK=mark, **state_dir))
    try:
        assert "m03 · " in proc.stdout.readline()                # the header comes at once
        end = time.monotonic() + 60
        while len(_processes_with(mark)) < 2 and time.monotonic() < end:   # the check process is running
            time.sleep(0.2)
        assert len(_processes_with(mark)) >= 2, "the grader never started its check process"
        os.killpg(proc.pid, signal.SIGINT)                      # what the terminal does on Ctrl-C
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err and "已中止" in err, (out, err)
    assert _processes_with(mark) == [], "a check process outlived Ctrl-C"


@pytest.mark.parametrize("width", [60, 80])
def test_show_wraps_table_cells_and_never_cuts_them(width):
    """rich's markdown tables cut a cell too wide for the terminal with "…" (k02's shape-trace cell "m + log₂ l",
    the one place its card says base 2, was hidden that way): ./check.sh show and hint fold them onto more lines."""
    import io
    import re
    from rich.console import Console
    from course.cli import CardMarkdown
    from course.grader import cards, registry
    for ex in registry.written():
        for level in (0, 3):
            console = Console(width=width, record=True, file=io.StringIO())
            console.print(CardMarkdown(cards.for_terminal(ex, level)))
            out = console.export_text()
            assert out.count("…") == cards.for_terminal(ex, level).count("…"), f"{ex.id} --level {level}: a cell was cut"
    cell = "`" + "lse = m + log₂ l；" * 12 + "`"                  # one long cell, longer than any terminal line
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(CardMarkdown(f"| a |\n|---|\n| {cell} |\n"))
    assert re.sub(r"\s+", "", cell.strip("`")) in re.sub(r"\s+", "", console.export_text())


def test_every_failing_check_is_explained():
    """Not only the first: a learner who forgets the online-softmax rescale fails the causal-mask check first,
    and the check that names the real mistake comes later."""
    from course import cli
    from course.grader import registry
    from course.grader.grade import Grade
    rows = [dict(name="test_a", point="A 检查", status="passed", message="", where=""),
            dict(name="test_b", point="B 检查", status="failed", message="B 不对\n  看起来像易错点：甲", where="mine/x.py:3"),
            dict(name="test_c", point="C 检查", status="error", message="RuntimeError: boom", where="mine/x.py:9"),
            dict(name="test_d", point="D 检查", status="timeout", message="超时：f 没有返回", where="mine/x.py:12"),
            dict(name="test_e", point="E 检查", status="timeout", message="超时：f 没有返回", where="mine/x.py:12"),
            dict(name="test_f", point="F 检查", status="todo", message="m03: 请实现 g", where="")]
    grade = Grade(registry.get("m03"), rows)
    with cli.console.capture() as cap:
        cli._print_summary(grade)
    text = cap.get()
    assert "4 个检查没有通过" in text
    for fragment in ("B 检查", "看起来像易错点：甲", "mine/x.py:3", "C 检查", "RuntimeError: boom", "mine/x.py:9",
                     "D 检查", "超时：f 没有返回", "E 检查", "原因同第 3 项"):
        assert fragment in text, fragment
    assert "A 检查" not in text and "F 检查" not in text
    assert text.count("超时：f 没有返回") == 1                      # the same cause is told once, then pointed to


def test_a_cpu_run_that_skipped_gpu_checks_is_passed_on_cpu_only(tmp_path, state_dir, monkeypatch):
    """Checks skipped for want of a GPU neither fail nor pass: the progress says 通过（CPU） until they ran."""
    from course.grader import registry, state
    from course.grader.grade import Grade
    k01 = registry.get("k01")
    row = lambda status, message="": dict(status=status, message=message)  # noqa: E731
    assert Grade(k01, [row("passed"), row("skipped", "需要 GPU")]).status == "passed_cpu"
    assert Grade(k01, [row("passed"), row("skipped", "需要 2 块 GPU（这台机器有 0 块）")]).status == "passed_cpu"
    assert Grade(k01, [row("passed"), row("passed")]).status == "passed"
    # on a one-GPU machine the tensor-parallel checks skip: that does not hold an exercise at passed_cpu
    assert Grade(k01, [row("passed"), row("skipped", "需要 2 块 GPU（这台机器有 1 块）")]).status == "passed"
    assert Grade(k01, [row("passed"), row("skipped", "需要 2 块 GPU（这台机器有 1 块）"),
                       row("skipped", "需要 GPU")]).status == "passed_cpu"
    assert Grade(k01, [row("passed"), row("failed"), row("skipped", "需要 GPU")]).status == "failed"
    monkeypatch.setenv(state.STATE_DIR_ENV, state_dir["COURSE_STATE_DIR"])
    state.record("k01", "passed_cpu", k01.stub, 7, 9)
    assert state.status_of("k01", k01.stub) == "passed_cpu" and "k01" in state.passed_ids(registry.CATALOGUE)
    out = cli(env_extra=state_dir)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "通过（CPU）" in text and "其中 1 个只在 CPU 上通过" in text, out.stdout
