"""`./check.sh ...`: the learner's one entry point.

    ./check.sh                      progress by track and the next exercise
    ./check.sh m03 [--solutions]    grade mine/m03_*.py (or the reference)
    ./check.sh all [--solutions]    grade every written exercise
    ./check.sh hint m03 --level 2   one level of the card's 三级提示
    ./check.sh show m03             the card, rendered in the terminal
    ./check.sh watch m03            re-grade whenever the file is saved
    ./check.sh reset m03            restore the stub (your file is kept in mine/.backup/)
    ./check.sh run --prompt TEXT    assemble the engine (your passed exercises + references) and generate
    ./check.sh selftest             the project's own test suite
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table

from . import cards, registry, state
from .grade import Grade, run_checks
from .select import ROOT

console = Console(highlight=False)


def say(*args, **kwargs) -> None:
    """Print plain lines without wrapping or cropping (file paths and messages stay whole)."""
    console.print(*args, soft_wrap=True, **kwargs)

STATUS_LABEL = {
    "passed": "[green]✓ 通过[/]",
    "changed": "[yellow]✓ 通过（之后文件有改动，重新运行以确认）[/]",
    "failed": "[red]✗ 未通过[/]",
    "todo": "[dim]· 未开始[/]",
    "coming": "[dim]… 即将推出[/]",
    "gpu": "[cyan]需要 GPU[/]",
}
RESULT_LABEL = {
    "passed": "[green]✓[/]",
    "failed": "[red]✗[/]",
    "error": "[red]✗ 出错[/]",
    "timeout": "[red]✗ 超时[/]",
    "todo": "[yellow]… 未实现[/]",
    "skipped": "[cyan]- 跳过[/]",
}


def _exercise(exercise_id: str) -> registry.Exercise:
    try:
        ex = registry.get(exercise_id)
    except KeyError as exc:
        say(f"[red]{exc.args[0]}[/]")
        raise SystemExit(2)
    if not ex.written:
        say(f"[yellow]{ex.id} 还没有写好（即将推出）。运行 ./check.sh 查看可做的练习。[/]")
        raise SystemExit(2)
    return ex


def overview() -> int:
    done = state.passed_ids(registry.CATALOGUE)
    for track, name in registry.TRACKS.items():
        table = Table(title=f"Track {track} · {name}", title_justify="left", show_header=False, box=None,
                      padding=(0, 1), title_style="bold")
        table.add_column("id", style="bold", no_wrap=True)
        table.add_column("title")
        table.add_column("status", no_wrap=True)
        for ex in (e for e in registry.CATALOGUE if e.track == track):
            if not ex.written:
                label = STATUS_LABEL["coming"]
            elif ex.needs_gpu:
                label = STATUS_LABEL["gpu"]
            else:
                label = STATUS_LABEL[state.status_of(ex.id, ex.stub)]
            table.add_row(ex.id, ex.title, label)
        console.print()
        console.print(table)
    total = len(registry.written())
    say(f"\n已通过 {len(done)}/{total} 个已发布的练习（目录共 {len(registry.CATALOGUE)} 个）。")
    nxt = registry.next_after(None, done)
    if nxt:
        say(f"下一个练习：[bold]{nxt.id}[/] {nxt.title}\n"
                      f"  读卡片：./check.sh show {nxt.id}    实现：{nxt.stub.relative_to(ROOT)}    "
                      f"验收：./check.sh {nxt.id}")
    else:
        say("所有已发布的练习都通过了。")
    return 0


def _print_grade(grade: Grade, source: str) -> None:
    ex = grade.exercise
    say(f"[bold]{ex.id} · {ex.title}[/]  [dim]({source}, {grade.seconds:.1f} s)[/]")
    for r in grade.results:
        say(f"  {RESULT_LABEL.get(r['status'], r['status'])} {r['point']}")
    if grade.crash:
        say(f"[red]{grade.crash}[/]")
        return
    failing = [r for r in grade.results if r["status"] in ("failed", "error", "timeout")]
    if failing:
        r = failing[0]
        say(f"\n[bold red]第一个失败的检查：{r['point']}[/]  [dim]({r['name']})[/]")
        say(r["message"], markup=False)
        if r.get("where"):
            say(f"  位置：{r['where']}", markup=False)
        say(f"  提示：./check.sh hint {ex.id} --level 1    卡片：./check.sh show {ex.id}")
    elif grade.all_todo:
        say(f"\n还没有实现：打开 {ex.stub.relative_to(ROOT)}，按卡片 lessons/{ex.card.name} 完成 "
                      f"NotImplementedError 处的函数。")


def grade_one(exercise_id: str, solutions: bool) -> int:
    ex = _exercise(exercise_id)
    selection = {"default": "solutions", ex.module: "solutions" if solutions else "mine"}
    source = f"{'solutions' if solutions else 'mine'}/{ex.module}.py"
    grade = run_checks(ex, selection)
    _print_grade(grade, source)
    n, total = grade.count("passed"), len(grade.results)
    if not solutions:
        status = "passed" if grade.passed else ("todo" if grade.all_todo else "failed")
        state.record(ex.id, status, ex.stub, n, total)
    if grade.passed:
        done = state.passed_ids(registry.CATALOGUE) | {ex.id}
        nxt = registry.next_after(ex.id, done)
        say(f"\n[green bold]全部 {total} 项通过。[/]")
        if not solutions:
            say(f"参考解：{ex.reference.relative_to(ROOT)}（讲解见书 附录 {ex.solution_ref}）。"
                          f"下一个练习：{nxt.id + ' ' + nxt.title if nxt else '没有了，全部完成！'}")
        return 0
    say(f"\n结果：{n}/{total} 项通过。")
    return 1


def grade_all(solutions: bool) -> int:
    code = 0
    for ex in registry.written():
        if ex.needs_gpu:
            continue
        code |= grade_one(ex.id, solutions)
        say()
    return code


def hint(exercise_id: str, level: int) -> int:
    ex = _exercise(exercise_id)
    try:
        console.print(Markdown(cards.hint(ex, level)))
    except KeyError as exc:
        say(f"[red]{exc.args[0]}[/]")
        return 2
    return 0


def show(exercise_id: str) -> int:
    ex = _exercise(exercise_id)
    console.print(Markdown(cards.for_terminal(ex)))
    return 0


def watch(exercise_id: str, solutions: bool, interval: float = 1.0) -> int:
    ex = _exercise(exercise_id)
    path = ex.reference if solutions else ex.stub
    say(f"监视 {path.relative_to(ROOT)}，保存即重新评分（Ctrl-C 退出）")
    last = None
    try:
        while True:
            mtime = path.stat().st_mtime if path.exists() else 0
            if mtime != last:
                last = mtime
                console.rule(time.strftime("%H:%M:%S"))
                grade_one(exercise_id, solutions)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def _pristine_stub(ex: registry.Exercise) -> str | None:
    rel = ex.stub.relative_to(ROOT).as_posix()
    for ref in ("origin/HEAD", "origin/main", "HEAD"):
        proc = subprocess.run(["git", "show", f"{ref}:{rel}"], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode == 0:
            return proc.stdout
    return None


def reset(exercise_id: str) -> int:
    ex = _exercise(exercise_id)
    original = _pristine_stub(ex)
    if original is None:
        say(f"[red]找不到 {ex.stub.name} 的原始版本（需要 git 仓库）。[/]")
        return 1
    backup_dir = ROOT / "mine" / ".backup"
    backup_dir.mkdir(exist_ok=True)
    backup = backup_dir / f"{ex.module}.{time.strftime('%Y%m%d-%H%M%S')}.py"
    if ex.stub.exists():
        shutil.copy2(ex.stub, backup)
    ex.stub.write_text(original, encoding="utf-8")
    say(f"已恢复 {ex.stub.relative_to(ROOT)} 为原始 stub；你的版本保存在 {backup.relative_to(ROOT)}")
    return 0


def selftest(args: list[str]) -> int:
    cmd = [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", *args]
    return subprocess.call(cmd, cwd=ROOT, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


def not_yet(command: str) -> int:
    say(f"[yellow]./check.sh {command}：GPU 总装与 benchmark 尚未发布（Track K / G 完成后提供）。[/]")
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return overview()
    command = argv[0]
    if command == "selftest":
        return selftest(argv[1:])
    if command == "run":
        from . import run
        return run.main(argv[1:], say)
    if command == "bench" and argv[1:2] == ["k03"]:
        from . import bench_k03
        return bench_k03.bench_k03(argv[2:], say)
    parser = argparse.ArgumentParser(prog="./check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command")
    parser.add_argument("exercise", nargs="?")
    parser.add_argument("--solutions", action="store_true", help="grade the reference in solutions/")
    parser.add_argument("--level", type=int, default=1, choices=(1, 2, 3))
    args = parser.parse_args(argv)
    if command in ("hint", "show", "watch", "reset"):
        if not args.exercise:
            say(f"[red]用法：./check.sh {command} <练习编号>，例如 ./check.sh {command} m03[/]")
            return 2
        if command == "hint":
            return hint(args.exercise, args.level)
        if command == "show":
            return show(args.exercise)
        if command == "watch":
            return watch(args.exercise, args.solutions)
        return reset(args.exercise)
    if command == "all":
        return grade_all(args.solutions)
    if command in ("gpu", "bench"):
        return not_yet(command)
    return grade_one(command, args.solutions)
