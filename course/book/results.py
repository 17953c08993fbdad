"""Measured numbers in the book come from committed result files: the chapter names the file, the build fills in.

A result file is the JSON a command wrote (`./check.sh bench ... --json results/<date>/<name>.json`): the command
line, the machine (GPU or CPU, driver, date) and the versions are inside. Two directives, expanded by
`course/book/build.py` when it stages a page:

A table: a fenced block whose info string is `result`, YAML inside.

    ```result
    file: results/2026-12-03/k01.json          # or a list of files: their rows one after another
    rows: rows                                  # the list (or one dict) in each file the rows come from
    where: name ~ ^add_rms_norm                 # optional: keep the rows whose field matches the regex
    columns:                                    # heading: expression | format
      测量: name
      每次调用: . | span
      带宽: rate | ,.0f GB/s
      占 copy 峰值: of_anchor | .1%
    ```

becomes the Markdown table and a caption line under it: the command, the machine, the date, the versions and the
file (`caption:` adds a sentence before them).

A number in running text: `{{ results/2026-12-03/k01.json rows[name~^add_rms_norm 8k x 4096].of_anchor | .1% }}`.

Expressions: a path of keys and list indices joined by dots, `.` for the row itself, `$.path` for the file's root;
a list element chosen by a field, `[name=exact]` or `[name~regex]` (the first match); a trailing `?` for a key some
rows lack (they show "—"); `a / b`, `a * b`, `a - b`,
`a + b` between paths or numbers, left to right. Formats: a Python format spec (`,.0f`, `.1%`), optionally after a
scale (`*1000 .1f µs`: the value times 1000) and followed by a unit; `span` (a timing row's median [min–max] in µs
or ms); `join .1f` (a list, " / " between); `map False=关 True=开`; `str`. A cell may hold several: `{tok_per_s | ,.0f} [{lo | ,.0f}–{hi | ,.0f}]`. None prints as "—". A missing key or a file without its
command, machine or versions is a ResultError: the build stops, and tests/test_book_results.py fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..grader.select import ROOT


class ResultError(ValueError):
    """A directive that cannot be rendered from its file, or a result file that does not say where it came from."""


BLOCK = re.compile(r"^```result[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
INLINE = re.compile(r"\{\{\s*(results/\S+\.json)\s+(.+?)\s*\}\}")
# What every result file says about where it was measured (machine_info() in course/bench/common.py)
MACHINE_KEYS = ("date", "python", "torch", "transformers")
GPU_KEYS = ("gpu", "driver", "cuda", "triton")


def load(path: str | Path, root: Path = ROOT) -> dict:
    """The result file (relative to the repo root), checked for its provenance."""
    file = root / path
    if not file.is_file():
        raise ResultError(f"{path}: no such result file")
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultError(f"{path}: not JSON ({exc})") from None
    missing = provenance_gaps(doc)
    if missing:
        raise ResultError(f"{path}: the result file lacks {', '.join(missing)}")
    return doc


def provenance_gaps(doc) -> list[str]:
    """What a result file lacks of its command, machine and versions (empty: nothing)."""
    if not isinstance(doc, dict):
        return ["a JSON object"]
    out = []
    if not str(doc.get("command", "")).startswith(("./check.sh ", "python -m course.")):
        out.append("command")
    machine = doc.get("machine")
    if not isinstance(machine, dict):
        return out + ["machine"]
    out += [f"machine.{k}" for k in MACHINE_KEYS if not machine.get(k)]
    if machine.get("gpu"):
        out += [f"machine.{k}" for k in GPU_KEYS if not machine.get(k)]
    elif not machine.get("cpu_count"):
        out.append("machine.gpu or machine.cpu_count")
    return out


# ---------------------------------------------------------------- expressions

_STEP = re.compile(r"\[([^\]=~]+)([=~])([^\]]*)\]|([^.\[]+)")
_OPS = re.compile(r"\s+([/*+-])\s+")


def get(value, path: str, root=None):
    """The value at `path` inside `value` (see the module docstring)."""
    path = path.strip()
    if path.startswith("$"):
        value, path = root, path[1:]
    if path in ("", "."):
        return value
    at = ""
    for m in _STEP.finditer(path.lstrip(".")):
        if m.group(4) is not None:
            key = m.group(4)
            if isinstance(value, list) and key.lstrip("-").isdigit() and -len(value) <= int(key) < len(value):
                value = value[int(key)]
            elif isinstance(value, dict) and key in value:
                value = value[key]
            else:
                raise ResultError(f"no {key!r} at {at or 'the top'}" + (f" (keys: {', '.join(map(str, value))})"
                                                                         if isinstance(value, dict) else ""))
            at += "." + key
        else:
            field, op, want = m.group(1).strip(), m.group(2), m.group(3).strip()
            if not isinstance(value, list):
                raise ResultError(f"[{field}{op}{want}] needs a list at {at or 'the top'}")
            hits = [v for v in value if isinstance(v, dict) and
                    (str(v.get(field)) == want if op == "=" else re.search(want, str(v.get(field, ""))))]
            if not hits:
                names = [str(v.get(field)) for v in value if isinstance(v, dict)]
                raise ResultError(f"no element with {field} {op} {want!r} at {at or 'the top'} ({field}: {names})")
            value = hits[0]
            at += f"[{field}{op}{want}]"
    return value


def evaluate(expr: str, row, root):
    parts = _OPS.split(expr.strip())
    def term(t: str):
        try:
            return float(t)
        except ValueError:
            pass
        if t.endswith("?"):                      # optional: a row without it shows "—"
            try:
                return get(row, t[:-1], root)
            except ResultError:
                return None
        return get(row, t, root)
    value = term(parts[0])
    for op, t in zip(parts[1::2], parts[2::2]):
        other = term(t)
        if value is None or other is None:
            return None
        value = {"/": lambda a, b: a / b, "*": lambda a, b: a * b, "+": lambda a, b: a + b,
                 "-": lambda a, b: a - b}[op](value, other)
    return value


def span(t: dict) -> str:
    """A timing row as the kernel benches print it: median [min–max], in µs under 1 ms."""
    try:
        mid, lo, hi = t["median_ms"], t["min_ms"], t["max_ms"]
    except (TypeError, KeyError):
        raise ResultError(f"span needs median_ms, min_ms and max_ms, got {t!r:.80}") from None
    scale, unit, digits = (1e3, "µs", 1) if mid < 1 else (1, "ms", 3)
    return f"{mid * scale:.{digits}f} [{lo * scale:.{digits}f}–{hi * scale:.{digits}f}] {unit}"


def fmt(value, spec: str) -> str:
    spec = spec.strip()
    if value is None:
        return "—"
    head, _, rest = spec.partition(" ")
    if head[:1] in "*/" and len(head) > 1:
        k = float(head[1:])
        value = value * k if head[0] == "*" else value / k
        head, _, rest = rest.partition(" ")
    if head == "span":
        return span(value) + (" " + rest if rest else "")
    if head == "join":
        sub, _, unit = rest.partition(" ")
        return " / ".join(fmt(v, sub) for v in value) + (" " + unit if unit else "")
    if head == "map":                              # `map False=关 True=开`: a value shown as a word
        words = dict(pair.split("=", 1) for pair in rest.split())
        if str(value) not in words:
            raise ResultError(f"map has no word for {value!r}")
        return words[str(value)]
    if head in ("", "str"):
        return str(value) + (" " + rest if rest else "")
    spec, glued = re.match(r"([<>=^]?[+\- ]?#?0?\d*[,_]?(?:\.\d+)?[bcdeEfFgGnosxX%]?)(.*)", head).groups()
    try:                                           # a unit may be glued to the spec: ".2f×"
        return format(value, spec) + glued + (" " + rest if rest else "")
    except (TypeError, ValueError):
        raise ResultError(f"format {head!r} does not apply to {value!r:.60}") from None


_PART = re.compile(r"\{([^{}]+)\}")


def cell(expr: str, row, root) -> str:
    """One cell: `expression | format`, or a template with several, `{a | ,.0f}–{b | ,.0f}`."""
    if "{" in expr:
        text = _PART.sub(lambda m: cell(m.group(1), row, root), expr)
    else:
        expr, _, spec = expr.partition(" | ")
        text = fmt(evaluate(expr, row, root), spec)
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------- tables and captions

def parse_block(body: str) -> dict:
    import yaml
    try:
        spec = yaml.safe_load(body)
    except yaml.YAMLError as exc:
        raise ResultError(f"result block is not YAML: {exc}") from None
    if not isinstance(spec, dict) or "file" not in spec or not isinstance(spec.get("columns"), dict):
        raise ResultError("a result block needs `file:` and `columns:` (heading: expression)")
    unknown = set(spec) - {"file", "rows", "where", "columns", "caption"}
    if unknown:
        raise ResultError(f"unknown keys in a result block: {sorted(unknown)}")
    files = spec["file"] if isinstance(spec["file"], list) else [spec["file"]]
    return dict(spec, file=[str(f) for f in files])


def table(spec: dict, docs: dict[str, dict]) -> list[list[str]]:
    """The table's rows of cells (the first row the headings)."""
    out = [[str(h) for h in spec["columns"]]]
    for path in spec["file"]:
        doc = docs[path]
        rows = get(doc, str(spec.get("rows", ".")), doc)
        rows = rows if isinstance(rows, list) else [rows]
        if where := spec.get("where"):
            field, _, pattern = str(where).partition("~")
            rows = [r for r in rows if re.search(pattern.strip(), str(get(r, field.strip(), doc)))]
        if not rows:
            raise ResultError(f"{path}: no rows" + (f" where {spec['where']}" if spec.get("where") else ""))
        for row in rows:
            try:
                out.append([cell(str(e), row, doc) for e in spec["columns"].values()])
            except ResultError as exc:
                raise ResultError(f"{path}: {exc}") from None
    return out


def machine_line(m: dict) -> str:
    if m.get("gpu"):
        where = f"{m['gpu']}" + (f" ×{m['gpu_count']}" if m.get("gpu_count", 1) > 1 else "") + \
                f"（driver {m.get('driver')}，CUDA {m.get('cuda')}）"
    else:
        where = f"CPU（{m.get('cpu_count')} 核）"
    versions = "、".join(f"{k} {m[k]}" for k in ("torch", "triton", "transformers", "fla-core") if m.get(k))
    return f"{where}；{versions}；Python {m.get('python')}"


def caption(spec: dict, docs: dict[str, dict]) -> str:
    cmds = "；".join(f"`{docs[p]['command']}`" for p in spec["file"])
    machines = list(dict.fromkeys(machine_line(docs[p]["machine"]) for p in spec["file"]))
    dates = sorted({docs[p]["machine"]["date"][:10] for p in spec["file"]})
    files = "、".join(f"`{p}`" for p in spec["file"])
    lead = f"{spec['caption'].rstrip('。')}。" if spec.get("caption") else ""
    return f"{lead}命令：{cmds}。环境：{'；'.join(machines)}。测于 {'、'.join(dates)}，结果文件 {files}。"


def render_block(body: str, root: Path = ROOT) -> str:
    spec = parse_block(body)
    docs = {p: load(p, root) for p in spec["file"]}
    rows = table(spec, docs)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines) + "\n\n" + f'<p class="result-caption" markdown="1">{caption(spec, docs)}</p>\n'


def render_inline(path: str, expr: str, root: Path = ROOT) -> str:
    doc = load(path, root)
    try:
        return cell(expr, doc, doc)
    except ResultError as exc:
        raise ResultError(f"{path}: {exc}") from None


def directives(text: str) -> list[tuple[int, str, str]]:
    """(line, kind, source) of every directive in a page: kind "block" (source: the YAML) or "inline" (the braces)."""
    out = [(text.count("\n", 0, m.start()) + 1, "block", m.group(1)) for m in BLOCK.finditer(text)]
    out += [(text.count("\n", 0, m.start()) + 1, "inline", m.group(0)) for m in INLINE.finditer(text)]
    return sorted(out)


def files_of(kind: str, source: str) -> list[str]:
    if kind == "block":
        return parse_block(source)["file"]
    return [INLINE.fullmatch(source).group(1)]


def expand(text: str, where: str = "", root: Path = ROOT) -> str:
    """The page with every directive replaced by what it renders to; ResultError names the page and line."""
    def at(m: re.Match) -> str:
        return f"{where}:{text.count(chr(10), 0, m.start()) + 1}"

    def block(m: re.Match) -> str:
        try:
            return render_block(m.group(1), root)
        except ResultError as exc:
            raise ResultError(f"{at(m)}: {exc}") from None

    def inline(m: re.Match) -> str:
        try:
            return render_inline(m.group(1), m.group(2), root)
        except ResultError as exc:
            raise ResultError(f"{at(m)}: {exc}") from None
    return INLINE.sub(inline, BLOCK.sub(block, text))
