"""Developer tool: write mine/<module>.py from solutions/<module>.py, turning the named functions into tasks.

    python -m course.grader.stubgen m06_models m06 MLP.forward DecoderLayer.forward load_checkpoint ...

Each named function (or Class.method) keeps its signature and docstring; its body becomes
`raise NotImplementedError("<id>: 请实现 <name>（见 lessons/<module>.md）")`. Everything else is copied,
so the stub mirrors the reference exactly (tests/test_api_mirror.py checks it).
"""

from __future__ import annotations

import ast
import sys

from .select import ROOT


def make_stub(module: str, exercise_id: str, tasks: list[str]) -> tuple[str, int]:
    source = (ROOT / "solutions" / f"{module}.py").read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    edits = []

    def visit(node, prefix=""):
        for item in node.body:
            if isinstance(item, ast.ClassDef):
                visit(item, prefix + item.name + ".")
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and prefix + item.name in tasks:
                first = item.body[0]
                has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                start = first.end_lineno if has_doc else first.lineno - 1
                indent = " " * (item.col_offset + 4)
                text = f'{indent}raise NotImplementedError("{exercise_id}: 请实现 {prefix}{item.name}（见 lessons/{module}.md）")\n'
                edits.append((start, item.end_lineno, text))

    visit(ast.parse(source))
    for start, end, text in sorted(edits, reverse=True):
        lines[start:end] = [text]
    return "".join(lines), len(edits)


def main(argv: list[str]) -> None:
    module, exercise_id, *tasks = argv
    stub, count = make_stub(module, exercise_id, tasks)
    if count != len(tasks):
        raise SystemExit(f"found {count} of {len(tasks)} tasks in solutions/{module}.py")
    (ROOT / "mine" / f"{module}.py").write_text(stub, encoding="utf-8")
    print(f"wrote mine/{module}.py with {count} tasks")


if __name__ == "__main__":
    main(sys.argv[1:])
