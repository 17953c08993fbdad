"""The book's measured numbers come from committed result files (course/book/results.py): every directive renders
from its file, every result file says which command wrote it on which machine with which versions, no chapter keeps
a measured table typed by hand, and the CPU results are what their command writes today. No book build, no browser."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from course.book import results
from course.grader import registry

ROOT = registry.ROOT
RESULTS = ROOT / "results"
PAGES = sorted([*(ROOT / "book").rglob("*.md"), *(ROOT / "lessons").glob("*.md")])
# A time or a rate: a unit in a heading (or the lines above a table), a number with its unit in a cell.
UNIT = r"(ms|µs|us|tok/s|GB/s|TB/s|TFLOP/s)(?![\w/])"
MEASURED = re.compile(r"(?<![\w/])" + UNIT)
MEASURED_CELL = re.compile(r"\d\s*" + UNIT)
NOT_MEASURED = re.compile(r"<!--\s*not measured:")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _result_files() -> list[Path]:
    return sorted(RESULTS.rglob("*.json")) if RESULTS.is_dir() else []


# ---------------------------------------------------------------- the renderer, on files made here

def _write(root: Path, rel: str, doc: dict) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(json.dumps(doc), encoding="utf-8")


GPU_MACHINE = dict(date="2026-01-02T03:04:05+00:00", python="3.11.7", torch="2.11.0+cu130", triton="3.6.0",
                   transformers="5.17.0", gpu="NVIDIA H200", gpu_count=1, driver="580.1", cuda="13.0")
KERNEL = dict(bench="k01", command="./check.sh bench k01 --solutions --json results/x/k01.json", machine=GPU_MACHINE,
              rows=[dict(name="anchor: device-to-device copy", median_ms=1.0, min_ms=0.99, max_ms=1.02, rate=4268.0,
                         of_anchor=None),
                    dict(name="add_rms_norm 8k x 4096", median_ms=0.0672, min_ms=0.0668, max_ms=0.0690,
                         rate=3995.2, of_anchor=0.9361)])
BLOCK = """```result
file: results/x/k01.json
rows: rows
where: name ~ ^add_rms_norm
columns:
  测量: name
  每次调用: . | span
  带宽: rate | ,.0f GB/s
  占 copy: of_anchor | .1%
  µs/调用: median_ms | *1000 .1f
  备注: note? | str
```"""


def test_a_block_renders_the_table_and_its_provenance(tmp_path):
    _write(tmp_path, "results/x/k01.json", KERNEL)
    page = f"前文\n\n{BLOCK}\n\n后文 {{{{ results/x/k01.json rows[name~4096].of_anchor | .1% }}}}。\n"
    out = results.expand(page, "book/x.md", root=tmp_path)
    assert "| 测量 | 每次调用 | 带宽 | 占 copy | µs/调用 | 备注 |\n|---|---|---|---|---|---|\n" in out
    assert "| add_rms_norm 8k x 4096 | 67.2 [66.8–69.0] µs | 3,995 GB/s | 93.6% | 67.2 | — |" in out
    assert "anchor" not in out.split("|---|")[1], "where: keeps only the matching rows"
    assert "后文 93.6%。" in out
    caption = re.search(r'<p class="result-caption" markdown="1">(.*)</p>', out).group(1)
    for part in ("`./check.sh bench k01 --solutions --json results/x/k01.json`", "NVIDIA H200", "driver 580.1",
                 "torch 2.11.0+cu130", "triton 3.6.0", "transformers 5.17.0", "2026-01-02", "`results/x/k01.json`"):
        assert part in caption, (part, caption)


def test_several_files_and_arithmetic(tmp_path):
    for name, rate in (("a", 100.0), ("b", 300.0)):
        _write(tmp_path, f"results/x/{name}.json",
               dict(command=f"./check.sh bench --model {name} --json results/x/{name}.json", machine=GPU_MACHINE,
                    workload=dict(model=name), results=[dict(tok_per_s=rate, seconds=2.0, runs=[1, 2])]))
    block = ("```result\nfile: [results/x/a.json, results/x/b.json]\nrows: results.0\ncolumns:\n"
             "  模型: $.workload.model\n  tok/s: tok_per_s | ,.0f\n  每秒的一半: tok_per_s / seconds | .1f\n  两个: \"{tok_per_s | ,.0f} [{seconds | .0f} s]\"\n```")
    out = results.expand(block, root=tmp_path)
    assert "| a | 100 | 50.0 | 100 [2 s] |\n| b | 300 | 150.0 | 300 [2 s] |" in out
    assert out.count("./check.sh bench --model") == 2 and out.count("NVIDIA H200") == 1


def test_formats():
    assert results.fmt(1.2534, ".2f×") == "1.25×" and results.fmt(0.843, ".1%") == "84.3%"
    assert results.fmt(0.0672, "*1000 .1f µs") == "67.2 µs" and results.fmt(None, ".1f") == "—"
    assert results.fmt([27.6, 21.25], "join .1f ms") == "27.6 / 21.2 ms"
    assert results.fmt(True, "map False=关 True=开") == "开"
    with pytest.raises(results.ResultError, match="does not apply"):
        results.fmt("text", ".1f")


def test_a_column_the_file_lacks_fails_naming_page_line_and_key(tmp_path):
    _write(tmp_path, "results/x/k01.json", KERNEL)
    with pytest.raises(results.ResultError, match=r"book/x\.md:3: results/x/k01\.json: no 'of_copy'"):
        results.expand("a\n\n" + BLOCK.replace("of_anchor | .1%", "of_copy | .1%"), "book/x.md", root=tmp_path)
    with pytest.raises(results.ResultError, match="no element with name ~ 'nope'"):
        results.expand("{{ results/x/k01.json rows[name~nope].rate | .0f }}", root=tmp_path)
    with pytest.raises(results.ResultError, match="no rows where"):
        results.expand(BLOCK.replace("^add_rms_norm", "^nothing"), root=tmp_path)


@pytest.mark.parametrize("drop", ["command", "machine.date", "machine.torch", "machine.transformers", "machine.gpu",
                                  "machine.driver", "machine.triton"])
def test_a_result_file_without_its_command_machine_or_versions_fails(tmp_path, drop):
    doc = json.loads(json.dumps(KERNEL))
    *parents, key = drop.split(".")
    target = doc
    for p in parents:
        target = target[p]
    del target[key]
    _write(tmp_path, "results/x/k01.json", doc)
    want = "machine.gpu or machine.cpu_count" if drop == "machine.gpu" else drop
    with pytest.raises(results.ResultError, match=re.escape(want)):
        results.expand(BLOCK, root=tmp_path)


def test_the_checker_finds_a_hand_written_measured_table():
    page = "| 测量 | 每次调用 |\n|---|---|\n| add_rms_norm | 18.0 µs |\n"
    assert _measured_tables(page) == [1]
    assert _measured_tables("<!-- not measured: arithmetic -->\n" + page) == []
    assert _measured_tables("| tensor | shape |\n|---|---|\n| ms | [N, 1] |\n") == []
    assert _measured_tables("```\n" + page + "```\n") == []
    assert _measured_tables("（prefill 单位 ms）：\n\n| 形状 | 本练习 |\n|---|---|\n| [1, 8192] | 0.544 |\n") == [3]


# ---------------------------------------------------------------- the book and results/

def _measured_tables(text: str) -> list[int]:
    """First lines of the Markdown tables (outside code) that carry a time or a rate (in a cell, or as the unit the
    two lines above give), unless an HTML comment `<!-- not measured: why -->` stands in those two lines."""
    lines, out, fenced, k = text.splitlines(), [], False, 0
    while k < len(lines):
        if lines[k].lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and lines[k].startswith("|") and k + 1 < len(lines) and re.match(r"^\|[-:| ]+\|\s*$",
                                                                                          lines[k + 1]):
            end = k
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            above = "\n".join(lines[max(0, k - 2):k])
            if (MEASURED.search(lines[k] + "\n" + above) or MEASURED_CELL.search("\n".join(lines[k + 2:end]))) \
                    and not NOT_MEASURED.search(above):
                out.append(k + 1)
            k = end
            continue
        k += 1
    return out


def test_no_measured_table_is_typed_by_hand():
    hits = [f"{_rel(p)}:{n}" for p in PAGES for n in _measured_tables(p.read_text(encoding="utf-8"))]
    assert not hits, ("tables of measured times or rates typed into a page: render them from the result file the "
                      "command wrote (a ```result block, course/book/results.py), or mark an arithmetic table "
                      f"<!-- not measured: why -->: {hits}")


def test_every_directive_renders_from_a_committed_result_file():
    tracked = set(subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    errors = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        found = results.directives(text)
        if found and page.parent.name == "lessons":
            errors.append(f"{_rel(page)}: a card is read in the terminal too (./check.sh show): cite the book's table")
            continue
        for line, kind, source in found:
            try:
                files = results.files_of(kind, source)
                for f in files:
                    if f not in tracked and (ROOT / ".git").exists():
                        errors.append(f"{_rel(page)}:{line}: {f} is not committed")
                results.expand(source if kind == "inline" else f"```result\n{source}```", f"{_rel(page)}:{line}")
            except results.ResultError as exc:
                errors.append(str(exc))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", _result_files(), ids=lambda p: _rel(p))
def test_a_result_file_names_its_command_machine_and_versions(path):
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert not results.provenance_gaps(doc), f"{_rel(path)} lacks {results.provenance_gaps(doc)}"
    argv = shlex.split(doc["command"])
    assert "--json" in argv and argv[argv.index("--json") + 1] == _rel(path), \
        f"{_rel(path)}: its command writes another file: {doc['command']}"


# ---------------------------------------------------------------- CPU results are what the command writes today

def _shape(value):
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def _counts(value, at=""):
    """Every integer outside `machine` and `command`: token, hit, step and request counts (times are floats)."""
    if isinstance(value, dict):
        return {k2: v2 for k, v in value.items() if k not in ("machine", "command", "argv")
                for k2, v2 in _counts(v, f"{at}.{k}").items()}
    if isinstance(value, list):
        return {k2: v2 for i, v in enumerate(value) for k2, v2 in _counts(v, f"{at}.{i}").items()}
    return {at: value} if isinstance(value, int) and not isinstance(value, bool) else {}


CPU_RESULTS = sorted((RESULTS / "cpu").glob("*.json")) if (RESULTS / "cpu").is_dir() else []


@pytest.mark.parametrize("path", CPU_RESULTS, ids=lambda p: _rel(p))
def test_a_cpu_result_is_what_its_command_writes_today(path, tmp_path):
    """Rerun the command the file names (a CPU smoke run: seconds) and compare: the same structure, the same counts
    (tokens, hits, steps), and every table and number the book renders from it identical (so the book shows
    only what does not depend on the machine's speed). Times are not compared: they are a smoke run's."""
    old = json.loads(path.read_text(encoding="utf-8"))
    argv = shlex.split(old["command"])[2:]                     # after "./check.sh bench"
    fresh_rel = _rel(path)
    argv[argv.index("--json") + 1] = str(tmp_path / fresh_rel)
    (tmp_path / fresh_rel).parent.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}       # a tiny model: more threads only fight the other tests
    proc = subprocess.run([sys.executable, "-m", "course", "bench", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    new = json.loads((tmp_path / fresh_rel).read_text(encoding="utf-8"))
    refresh = f"refresh it: {old['command']}"
    assert _shape(new) == _shape(old), f"{fresh_rel}: the command now writes other fields; {refresh}"
    changed = {k: (v, _counts(new).get(k)) for k, v in _counts(old).items() if _counts(new).get(k) != v}
    assert not changed, f"{fresh_rel}: counts differ (committed, now): {changed}; {refresh}"
    for page in PAGES:
        for line, kind, source in results.directives(page.read_text(encoding="utf-8")):
            if fresh_rel in results.files_of(kind, source):
                text = source if kind == "inline" else f"```result\n{source}```"
                strip = lambda s: re.sub(r'<p class="result-caption".*</p>', "", s)          # noqa: E731
                assert strip(results.expand(text, root=tmp_path)) == strip(results.expand(text)), \
                    f"{_rel(page)}:{line} renders differently from a fresh run; {refresh}"
