"""`python -m course.bench.repeat_check FILE.json ...`: do several runs of the kernel benches agree on every verdict?

Reads the --json files of `./check.sh bench k01|k02|k03|k04 --json FILE` (common.Report), groups them by bench in
the order given, and prints for each bench the runs' commands side by side with, per row, every run's median, spread
and verdict, the difference between the runs' medians, and whether the verdicts agree. A verdict missing from a run
(the run died before that row) counts as a disagreement. Exit status 0 when every bench's runs agree on every verdict
(and each bench has --expect runs), else 1.

    python -m course.bench.repeat_check --run 3 --out DIR [--budget S] [--solutions] k01 k02 k03 k04

runs each named bench 3 times in a row first (`./check.sh bench k01 [--solutions] --json DIR/k01-1.json`, its output
in DIR/k01-1.log), then compares those files. --budget S: no run starts once S seconds have passed since the first,
and a run still going then gets SIGTERM (the bench saves the rows it has; SIGKILL 20 s later).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

SYMBOL = {"pass": "✓", "fastest": "✓", "faster": "✓", "fail": "✗", "slower": "✗", "undecided": "?", "overlap": "?",
          "noisy": "⚠"}
LEGEND = ("✓ 达标 / 最快 / 更快   ✗ 未达标 / 更慢   ? 区间跨过目标或重叠，不下结论   ⚠ 波动过大，不下结论   "
          "— 这一遍没有这一行")


def _time(ms: float) -> str:
    return f"{ms * 1e3:.1f}µs" if ms < 1 else f"{ms:.3f}ms"


def _cell(row: dict | None, verdict: str | None) -> str:
    if row is None:
        return "—"
    text = ""
    if "median_ms" in row:
        text = f"{_time(row['median_ms'])} ({row['spread']:.1%})"
    if verdict is not None:
        key = row.get("verdicts", {}).get(verdict)
        text += f" {SYMBOL.get(key, '—') if key else '—'}"
    return text.strip()


def compare(runs: list[dict]) -> tuple[list[str], list[str]]:
    """The lines of one bench's comparison and the disagreements (row: verdicts per run)."""
    from rich.cells import cell_len
    names: list[str] = []
    for run in runs:
        for row in run["rows"]:
            if row["name"] not in names:
                names.append(row["name"])
    by_run = [{row["name"]: row for row in run["rows"]} for run in runs]
    labels = [f"{row['name']} [{v}]" for run in runs for row in run["rows"] for v in row.get("verdicts", {})]
    width = max(cell_len(n) for n in names + labels) + 2 if names else 20
    lines = [f"  {'':<{width}}" + "".join(f"{f'run {i + 1}':<24}" for i in range(len(runs)))
             + f"{'medians differ':<16}agree?"]
    disagree = []
    for name in names:
        rows = [r.get(name) for r in by_run]
        verdicts: list[str] = []
        for row in rows:
            for v in (row or {}).get("verdicts", {}):
                if v not in verdicts:
                    verdicts.append(v)
        medians = [r["median_ms"] for r in rows if r and "median_ms" in r]
        differ = f"{max(medians) / min(medians) - 1:.1%}" if len(medians) > 1 and min(medians) > 0 else ""
        for v in verdicts or [None]:
            label = name if v is None else f"{name} [{v}]"
            keys = [(row or {}).get("verdicts", {}).get(v) if v else None for row in rows]
            if v is None:
                agree = "" if all(rows) else "✗ 缺行"
            elif all(k is not None for k in keys) and len(set(keys)) == 1:
                agree = "✓"
            else:
                agree = "✗"
                disagree.append(f"{label}: " + " / ".join(k or "—" for k in keys))
            cells = "".join(f"{_cell(row, v):<24}" for row in rows)
            lines.append(f"  {label}{' ' * (width - cell_len(label))}{cells}{differ:<16}{agree}")
            label = ""
    return lines, disagree


def run_benches(benches: list[str], times: int, out: Path, budget: float, solutions: bool) -> list[str]:
    """Each bench `times` times in a row through ./check.sh; the --json files written, in order."""
    check = Path(__file__).resolve().parents[2] / "check.sh"
    out.mkdir(parents=True, exist_ok=True)
    start, files, lines = time.monotonic(), [], []
    for bench in benches:
        for i in range(1, times + 1):
            path, log = out / f"{bench}-{i}.json", out / f"{bench}-{i}.log"
            cmd = [str(check), "bench", bench] + (["--solutions"] if solutions else []) + ["--json", str(path)]
            left = budget - (time.monotonic() - start) if budget else None
            if left is not None and left < 15:
                lines.append(f"{bench} run {i}: not started (the {budget:.0f} s budget is spent)")
                print(lines[-1], flush=True)
                continue
            t = time.monotonic()
            with open(log, "w", encoding="utf-8") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=check.parent)
                try:
                    code = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGTERM)            # the bench saves the rows it has measured
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                    code = "stopped at the budget"
            lines.append(f"{bench} run {i}: exit {code}, {time.monotonic() - t:.0f} s   ./check.sh {' '.join(cmd[1:])}")
            print(lines[-1], flush=True)
            if path.exists():
                files.append(str(path))
    (out / "runs.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.bench.repeat_check",
                                     description="do several runs of the kernel benches agree on every verdict?")
    parser.add_argument("files", nargs="+", help="the --json files of the runs (with --run: the benches to run)")
    parser.add_argument("--expect", type=int, default=0, metavar="N", help="runs each bench should have")
    parser.add_argument("--run", type=int, default=0, metavar="N", help="run each named bench N times first")
    parser.add_argument("--out", default="build/bench-runs", metavar="DIR", help="where --run writes logs and JSON")
    parser.add_argument("--budget", type=float, default=0, metavar="S", help="--run: seconds for all runs together")
    parser.add_argument("--solutions", action="store_true", help="--run: pass --solutions to every bench")
    opts = parser.parse_args(argv)
    asked = list(opts.files) if opts.run else []                # the benches --run was asked for
    if opts.run:
        opts.files = run_benches(opts.files, opts.run, Path(opts.out), opts.budget, opts.solutions)
        opts.expect = opts.expect or opts.run
    benches: dict[str, list[dict]] = {}
    broken = []
    for path in opts.files:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            broken.append(f"{path}: {exc}")
            continue
        data["_path"] = path
        benches.setdefault(data["bench"], []).append(data)
    ok = not broken
    for line in broken:
        print(f"读不了：{line}")
    summary = []
    for bench, runs in benches.items():
        first = runs[0].get("machine", {})
        print(f"\n== {bench}: {len(runs)} 遍，{first.get('gpu') or '?'}（driver {first.get('driver') or '?'}），"
              f"torch {first.get('torch', '?')}，triton {first.get('triton', '?')}；"
              f"每行重放 {runs[0].get('replays')} 次，波动上限 {runs[0].get('spread_limit', 0):.0%}")
        for i, run in enumerate(runs):
            print(f"  run {i + 1}: {run.get('command')}   ({run.get('machine', {}).get('date', '?')}, {run['_path']})")
        lines, disagree = compare(runs)
        print("\n".join(lines))
        few = opts.expect and len(runs) < opts.expect
        if disagree or few:
            ok = False
        state = ("✓ 每个结论都一致" if not disagree else f"✗ {len(disagree)} 个结论不一致") + \
                (f"（只有 {len(runs)} 遍，应有 {opts.expect} 遍）" if few else "")
        summary.append(f"  {bench}: {state}")
        for line in disagree:
            summary.append(f"      {line}")
    print(f"\n（每格：这一遍的中位数（波动 (最大−最小)/中位数）和结论；medians differ：几遍中位数的 最大/最小 − 1；{LEGEND}）")
    print("\n== 总结（同一命令跑几遍，结论是否一致）")
    print("\n".join(summary) if summary else "  没有可比较的结果")
    missing = [b for b in asked if b not in benches]
    if missing:
        ok = False
        print(f"  缺少：{'、'.join(missing)}（没有一遍留下 JSON）")
    print("全部一致" if ok else "有不一致或缺失")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
