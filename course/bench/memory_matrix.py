"""`python -m course.bench.memory_matrix DIR --json FILE`: the memory matrix of tests/test_gpu_memory.py as one table.

DIR is the test's COURSE_MATRIX_OUT: matrix.jsonl (one line per cell: exit code, seconds, the refusal paragraph) and
each cell's bench JSON. FILE gets every cell in the matrix's order (cap, then model), with the memory plan's figures
of the cells that ran and the weights and GDN pool named by the refusals, plus the machine the cells ran on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

GIB = 2 ** 30
CAPS = (24, 48, 80)
MODELS = (("qwen3-0.6b", "bf16"), ("qwen3-30b-a3b", "bf16"), ("qwen3-30b-a3b", "w8a8"), ("qwen3.5-35b-a3b", "w8a8"))


def cell_row(folder: Path, summary: dict) -> tuple[dict, dict | None]:
    """(the table row of one cell, its bench JSON's machine or None)."""
    cap, rest = summary["cell"].split("GiB-", 1)
    model, dtype = rest.rsplit("-", 1)
    row = dict(cell=summary["cell"], cap_gib=int(cap), model=model, dtype=dtype, seconds=summary["seconds"])
    if summary["exit"] == 0:
        doc = json.loads((folder / f"{summary['cell']}.json").read_text(encoding="utf-8"))
        result, plan = doc["results"][0], doc["results"][0]["memory_plan"]
        row.update(outcome="运行完", tok_per_s=result["tok_per_s"], budget_gib=plan["budget_bytes"] / GIB,
                   weights_gib=sum(w["bytes"] for w in plan["weights"].values()) / GIB,
                   gdn_gib=plan["gdn_pool_bytes"] / GIB, kv_blocks=plan["num_blocks"], kv_gib=plan["kv_bytes"] / GIB,
                   activations_gib=plan["activation_bytes"] / GIB, graphs_gib=plan["graph_bytes"] / GIB,
                   left_gib=plan["left_bytes"] / GIB, left_error=plan["left_error_of_card"])
        return row, doc["machine"]
    message = summary.get("refused") or ""
    if not message:
        return dict(row, outcome=f"失败（exit {summary['exit']}）"), None
    seqs = re.search(r"max_num_seqs 降到 (\d+)", message)
    gdn = re.search(r"GDN 状态池 ([\d.]+) GiB", message)
    row.update(outcome="启动时拒绝（加载权重之前）" if "加载权重之前" in message else "启动时拒绝（分配 KV cache 之前）",
               weights_gib=float(re.search(r"权重 ([\d.]+) GiB", message).group(1)),
               gdn_gib=float(gdn.group(1)) if gdn else 0.0, message=message,
               suggested_max_num_seqs=int(seqs.group(1)) if seqs else None)
    return row, None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.bench.memory_matrix")
    parser.add_argument("folder", type=Path, help="COURSE_MATRIX_OUT of tests/test_gpu_memory.py")
    parser.add_argument("--json", required=True, metavar="FILE")
    args = parser.parse_args(argv)
    latest = {}
    for line in (args.folder / "matrix.jsonl").read_text(encoding="utf-8").splitlines():
        summary = json.loads(line)
        latest[summary["cell"]] = summary                # a cell run twice: its last run counts
    rows, machine, not_run = [], None, []
    for cap in CAPS:
        for model, dtype in MODELS:
            name = f"{cap}GiB-{model}-{dtype}"
            if name not in latest:
                not_run.append(name)
                continue
            row, m = cell_row(args.folder, latest[name])
            rows.append(row)
            machine = machine or m
    if machine is None:
        print("no cell ran: the matrix has no machine to name", file=sys.stderr)
        return 1
    doc = dict(command=" ".join(["python -m course.bench.memory_matrix", *argv]), machine=machine, cells=rows,
               not_run=not_run, each_cell="./check.sh bench --model M --dtype D --gpu-memory-gib N --json FILE")
    Path(args.json).write_text(json.dumps(doc, ensure_ascii=False, indent=1), encoding="utf-8")
    for row in rows:
        print(f"{row['cell']:32} {row['outcome']}")
    print("not run: " + (", ".join(not_run) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
