"""`./check.sh ...`: the learner's one entry point.

    ./check.sh                      progress by track and the next exercise
    ./check.sh m03 [--solutions]    grade mine/m03_*.py (or the reference)
    ./check.sh all [--solutions]    grade every written exercise
    ./check.sh hint m03 --level 2   one level of the card's 三级提示
    ./check.sh show m03 [--level N] the card, rendered in the terminal (hints L1..LN opened; default none)
    ./check.sh watch m03            re-grade whenever the file is saved
    ./check.sh reset m03            restore the stub (your file is kept in mine/.backup/)
    ./check.sh run [--model M]      assemble the engine (passed exercises + references), generate, and say which
                                    exercises the model ran (M: tiny, the default; tiny-hybrid; an HF folder)
    ./check.sh serve [--model DIR]  the same engine behind an OpenAI-compatible HTTP server (e06)
    ./check.sh bench --help         the benchmarks: every workload, subcommand and option (course/bench/cli.py)
    ./check.sh selftest             the project's own test suite
    ./check.sh mutants [e07 ...]    mutation testing of the checks (developers; CONTRIBUTING.md)
    ./check.sh lock [--upgrade]     regenerate the lock, requirements/ (maintainers; grader/lock.py)
    ./check.sh book [--open] [--serve [--no-build] [--port N]]   build (and serve) the book: build/book/site/, build/book/book.pdf
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from rich import box
from rich.console import Console
from rich.markdown import Markdown, TableElement
from rich.markup import escape
from rich.table import Table

from .grader import cards, registry, state
from .grader.grade import CHECK_TIMEOUT_S, Grade, run_checks
from .grader.select import ROOT

console = Console(highlight=False)


def say(*args, **kwargs) -> None:
    """Print plain lines without wrapping or cropping (file paths and messages stay whole)."""
    console.print(*args, soft_wrap=True, **kwargs)

STATUS_LABEL = {
    "passed": "[green]✓ 通过[/]",
    "passed_cpu": "[cyan]✓ 通过（CPU）：需要 GPU 的检查还没运行，在 GPU 上再验收一次[/]",
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
    "notrun": "[yellow]- 未运行[/]",
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
            status = state.status_of(ex.id, ex.stub) if ex.written else "coming"
            label = STATUS_LABEL["gpu" if ex.needs_gpu and status == "todo" else status]
            table.add_row(ex.id, ex.title, label)
        console.print()
        console.print(table)
    total = len(registry.written())
    cpu_only = sum(state.status_of(i, registry.get(i).stub) == "passed_cpu" for i in done)
    say(f"\n已通过 {len(done)}/{total} 个已发布的练习（目录共 {len(registry.CATALOGUE)} 个）"
        + (f"，其中 {cpu_only} 个只在 CPU 上通过（需要 GPU 的检查还没运行）。" if cpu_only else "。"))
    nxt = registry.next_after(None, done)
    if nxt:
        say(f"下一个练习：[bold]{nxt.id}[/] {nxt.title}\n"
                      f"  读卡片：./check.sh show {nxt.id}    实现：{nxt.stub.relative_to(ROOT)}    "
                      f"验收：./check.sh {nxt.id}")
    else:
        say("所有已发布的练习都通过了。")
    return 0


def _progress(kind: str, data: dict) -> None:
    """Called by run_checks as the check process reports: the plan, then one line per finished check."""
    if kind == "plan":
        say(f"[dim]{len(data['checks'])} 个检查，每个检查最多 {data['limit']:g} 秒（Ctrl-C 中止）[/]")
    elif kind == "result":
        reason = f"  [dim]({escape(data['message'].removeprefix('Skipped: '))})[/]" if data["status"] == "skipped" else ""
        say(f"  {RESULT_LABEL.get(data['status'], data['status'])} {escape(data['point'])}{reason}")


def _print_summary(grade: Grade) -> None:
    ex = grade.exercise
    if grade.crash:
        say(f"[red]{grade.crash}[/]")
        return
    failing = grade.failing
    if failing:
        say(f"\n[bold red]{len(failing)} 个检查没有通过，逐个说明（一个错误常让几个检查一起失败：每条都读一读，"
            "点名易错点的那条最可能是原因）：[/]" if len(failing) > 1 else "\n[bold red]没有通过的检查：[/]")
        for line in failure_report(failing):
            say(line, markup=False)
        say(f"\n  提示：./check.sh hint {ex.id} --level 1    卡片：./check.sh show {ex.id}")
    elif grade.all_skipped:
        say(f"\n[cyan]全部跳过：{grade.results[0]['message']}[/]", markup=True)
    elif grade.all_todo:
        say(f"\n还没有实现：打开 {ex.stub.relative_to(ROOT)}，按卡片 lessons/{ex.card.name} 完成 "
                      f"NotImplementedError 处的函数。")


def failure_report(failing: list[dict]) -> list[str]:
    """Every failing check, numbered, with its whole message and location; a check that failed for exactly the
    same reason as an earlier one (a hung function, a crash in a shared step) points back to it."""
    lines, seen = [], {}
    for i, r in enumerate(failing, 1):
        lines.append(f"\n{i}. {r['point']}  ({r['name']})")
        key = (r["message"], r.get("where", ""))
        if key in seen:
            lines.append(f"  原因同第 {seen[key]} 项")
            continue
        seen[key] = i
        lines.append(r["message"])
        if r.get("where"):
            lines.append(f"  位置：{r['where']}")
    return lines


def grade_one(exercise_id: str, solutions: bool) -> int:
    ex = _exercise(exercise_id)
    selection = {"default": "solutions", ex.module: "solutions" if solutions else "mine"}
    source = f"{'solutions' if solutions else 'mine'}/{ex.module}.py"
    say(f"[bold]{ex.id} · {ex.title}[/]  [dim]({source})[/]")
    say("[dim]启动检查进程（导入 torch / transformers）……[/]")
    grade = run_checks(ex, selection, on_event=_progress)
    _print_summary(grade)
    n, total = grade.count("passed"), len(grade.results)
    if not solutions and not grade.all_skipped:
        state.record(ex.id, grade.status, ex.stub, n, total)
    if grade.passed:
        done = state.passed_ids(registry.CATALOGUE) | {ex.id}
        nxt = registry.next_after(ex.id, done)
        skipped = grade.count("skipped")
        if not skipped:
            say(f"\n[green bold]全部 {total} 项通过。[/] [dim]({grade.seconds:.1f} s)[/]")
        elif grade.status == "passed":
            say(f"\n[green bold]通过：{n} 项通过。[/]{skipped} 项需要更多 GPU、没有运行（见上面的“跳过”行）；"
                f"单卡机器上这不影响验收。 [dim]({grade.seconds:.1f} s)[/]")
        elif grade.gpu_skipped:
            say(f"\n[cyan bold]通过（CPU）：{n} 项通过，{skipped} 项需要 GPU、没有运行。[/]这还不是验收通过："
                f"在 GPU 上再运行 ./check.sh {ex.id}，全部通过后进度才记为“通过”。")
        else:
            say(f"\n[green bold]{n} 项通过[/]，{skipped} 项跳过。")
        if not solutions:
            say(f"参考解：{ex.reference.relative_to(ROOT)}（讲解见书 附录 {ex.solution_ref}）。"
                          f"下一个练习：{nxt.id + ' ' + nxt.title if nxt else '没有了，全部完成！'}")
        return 0
    say(f"\n结果：{n}/{total} 项通过。 [dim]({grade.seconds:.1f} s)[/]")
    return 1


def grade_all(solutions: bool) -> int:
    code = 0
    for ex in registry.written():
        if ex.needs_gpu:
            continue
        code |= grade_one(ex.id, solutions)
        say()
    return code


class _WrappingTable(TableElement):
    """rich's markdown table with every column folding its text onto more lines: a cell too wide for the
    terminal wraps (rich's default cuts it with "…", and a card's table cell may be the only place a fact is)."""

    def __rich_console__(self, console, options):
        table = Table(box=box.SIMPLE, pad_edge=False, style="markdown.table.border", show_edge=True,
                      collapse_padding=True)
        if self.header is not None and self.header.row is not None:
            for column in self.header.row.cells:
                heading = column.content.copy()
                heading.stylize("markdown.table.header")
                table.add_column(heading, overflow="fold")
        if self.body is not None:
            for row in self.body.rows:
                table.add_row(*[cell.content for cell in row.cells])
        yield table


class CardMarkdown(Markdown):
    """The cards and hints in the terminal: rich's Markdown, tables wrapped instead of cut."""

    elements = {**Markdown.elements, "table_open": _WrappingTable}


def hint(exercise_id: str, level: int) -> int:
    ex = _exercise(exercise_id)
    try:
        console.print(CardMarkdown(cards.hint(ex, level)))
    except KeyError as exc:
        say(f"[red]{exc.args[0]}[/]")
        return 2
    if level < 3:
        say(f"[dim]下一级提示：./check.sh hint {ex.id} --level {level + 1}[/]")
    return 0


def show(exercise_id: str, level: int = 0) -> int:
    ex = _exercise(exercise_id)
    console.print(CardMarkdown(cards.for_terminal(ex, level)))
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
    from .grader import lock
    # pyproject's test-only dependency group, when it has one (installed into .venv on first use)
    if not lock.ensure("group-test") and lock.in_course_venv():
        return 1
    cmd = [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", *args]
    return subprocess.call(cmd, cwd=ROOT, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})


def gpu_check(args: list[str]) -> int:
    """`./check.sh gpu`: g01's checks on the engine assembled from the passed exercises (references for the rest)."""
    import torch
    args = list(args)
    if "--gpu-memory-gib" in args:            # a smaller card, emulated: every engine the checks build plans for N GiB
        i = args.index("--gpu-memory-gib")
        try:
            cap = float(args[i + 1])
            assert cap > 0
        except (IndexError, ValueError, AssertionError):
            say("[red]./check.sh gpu --gpu-memory-gib N：N 是正数（GiB）[/]")
            return 2
        from .runtime.memory import ENV_CAP
        os.environ[ENV_CAP] = str(cap)
        del args[i:i + 2]
    if args and args != ["--solutions"]:
        say(f"[red]./check.sh gpu 不认识参数 {' '.join(args)}（只接受 --solutions 与 --gpu-memory-gib N）[/]")
        return 2
    if not torch.cuda.is_available():
        say("[yellow]./check.sh gpu 需要 NVIDIA GPU（CUDA）：这台机器没有，GPU 校验没有运行（不算通过）。[/]")
        return 2
    from .runtime import run
    ex = registry.get("g01")
    selection, report = run.auto_selection(gpu=True)
    if args == ["--solutions"]:
        selection = {"default": "solutions"}
        report = [(i, f"solutions/{registry.get(i).module}.py") for i, _ in report]
    say(f"[bold]{ex.id} · {ex.title}[/]  [dim](assembled engine)[/]")
    say("[bold]引擎由这些文件组装[/]：" + "，".join(path for _, path in report))
    grade = run_checks(ex, selection, on_event=_progress)
    _print_summary(grade)
    return 0 if grade.passed else 1


HELP = """用法：
  ./check.sh                              进度与下一个练习
  ./check.sh m03 [--solutions]            验收 mine/m03_*.py（--solutions：验收参考实现）
  ./check.sh all [--solutions]            依次验收所有已发布的练习
  ./check.sh hint m03 [--level 1|2|3]     三级提示中的一级
  ./check.sh show m03 [--level 0|1|2|3]   在终端里读卡片；三级提示默认折叠，--level N 展开到第 N 级
  ./check.sh watch m03 [--solutions]      保存即重新验收（Ctrl-C 退出）
  ./check.sh reset m03                    把 mine/ 里的文件恢复为原始 stub（你的版本备份到 mine/.backup/）
  ./check.sh run [--model tiny-hybrid]    用你已通过的练习组装引擎并生成，说出模型用到了哪些练习
  ./check.sh bench --help                 基准测试的每个负载、子命令和选项
  ./check.sh selftest                     项目自测
每个检查最多 {limit} 秒（COURSE_CHECK_TIMEOUT=秒数 可以放宽）。"""


class UsageError(Exception):
    """A command line that is not understood: printed in Chinese with the command's usage, exit 2."""


USAGE = {
    "grade": "./check.sh <练习编号> [--solutions]",
    "all": "./check.sh all [--solutions]",
    "hint": "./check.sh hint <练习编号> [--level 1|2|3]",
    "show": "./check.sh show <练习编号> [--level 0|1|2|3]",
    "watch": "./check.sh watch <练习编号> [--solutions]",
    "reset": "./check.sh reset <练习编号>",
    "gpu": "./check.sh gpu", "bench": "./check.sh bench",
}
# command: (takes an exercise id, its options: name -> allowed values, or None for a flag)
GRAMMAR = {
    "grade": (False, {"--solutions": None}),      # the exercise id is the command itself
    "all": (False, {"--solutions": None}),
    "hint": (True, {"--level": ("1", "2", "3")}),
    "show": (True, {"--level": ("0", "1", "2", "3")}),
    "watch": (True, {"--solutions": None}),
    "reset": (True, {}),
    "gpu": (False, {}), "bench": (False, {}),
}


def parse(command: str, args: list[str]) -> tuple[str | None, dict[str, str | bool]]:
    """(exercise id, options) of `command`'s arguments; anything unexpected is a UsageError."""
    takes_exercise, allowed = GRAMMAR[command]
    exercise, options, rest = None, {}, list(args)
    while rest:
        arg = rest.pop(0)
        name, _, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if arg.startswith("-"):
            if name not in allowed:
                known = f"可用的选项：{'、'.join(allowed)}" if allowed else "这个命令没有选项"
                raise UsageError(f"不认识的选项 {arg}（{known}）")
            if name in options:
                raise UsageError(f"选项 {name} 给了两次")
            choices = allowed[name]
            if choices is None:
                if value:
                    raise UsageError(f"选项 {name} 不带值")
                options[name] = True
                continue
            if not value:
                if not rest:
                    raise UsageError(f"选项 {name} 需要一个值：{'、'.join(choices)}")
                value = rest.pop(0)
            if value not in choices:
                raise UsageError(f"{name} 只能是 {'、'.join(choices)}，得到 {value!r}")
            options[name] = value
        elif takes_exercise and exercise is None:
            exercise = arg
        else:
            raise UsageError(f"多余的参数 {arg!r}")
    if takes_exercise and exercise is None:
        raise UsageError("缺少练习编号")
    return exercise, options


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return overview()
    command = argv[0]
    if command in ("-h", "--help", "help"):
        say(HELP.format(limit=CHECK_TIMEOUT_S), markup=False)
        return 0
    if command == "selftest":
        return selftest(argv[1:])
    if command == "lock":
        from .grader import lock
        return lock.main(argv[1:])
    if command == "mutants":
        from .grader import mutants
        return mutants.main(argv[1:])
    if command == "book":
        from .book import build as bookbuild
        return bookbuild.main(argv[1:])
    if command == "run":
        from .runtime import run
        return run.main(argv[1:], say)
    if command == "serve":
        from .runtime import serve
        return serve.main(argv[1:], say)
    if command == "bench":
        from .bench import cli as bench
        return bench.main(argv[1:], say)
    if command == "gpu":
        return gpu_check(argv[1:])
    key = command if command in GRAMMAR and command != "grade" else "grade"
    if key == "grade" and command.startswith("-"):
        say(f"./check.sh：不认识的命令 {command}（用法见 ./check.sh --help）", style="red", markup=False)
        return 2
    try:
        exercise, options = parse(key, argv[1:])
    except UsageError as exc:
        say(f"./check.sh {command}：{exc}", style="red", markup=False)
        say(f"用法：{USAGE[key]}", markup=False)
        return 2
    solutions = bool(options.get("--solutions"))
    if key == "hint":
        return hint(exercise, int(options.get("--level", 1)))
    if key == "show":
        return show(exercise, int(options.get("--level", 0)))
    if key == "watch":
        return watch(exercise, solutions)
    if key == "reset":
        return reset(exercise)
    if key == "all":
        return grade_all(solutions)
    return grade_one(command, solutions)
