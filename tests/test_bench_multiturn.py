"""`./check.sh bench --workload multiturn` (e07) on the CPU: the tiny hybrid, prefix caching off and on."""

import json
import os
import subprocess
import sys

from course.grader import select


def test_multiturn_bench_smoke(tmp_path):
    env = dict(os.environ, COURSE_STATE_DIR=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "course", "bench", "--workload", "multiturn", "--device", "cpu",
                          "--conversations", "3", "--turns", "2", "--system-len", "40", "--message-len", "8",
                          "--answer-len", "4", "--fixed-answers", "--repeats", "2"], cwd=select.ROOT, capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("BENCH_JSON "))
    result = json.loads(line.split(" ", 1)[1])
    off, on = result["off"], result["on"]
    assert off["prompt_tokens"] == on["prompt_tokens"] and off["output_tokens"] == on["output_tokens"] == 6 * 4
    assert off["prefill_computed"] == off["prompt_tokens"] and off["snapshot_hits"] == 0
    assert on["snapshot_hits"] >= 3 and on["prefill_computed"] < off["prefill_computed"], result
    assert "prefill tokens computed" in out.stdout and "mean TTFT" in out.stdout
    assert off["triton_compiles_in_timed_run"] == on["triton_compiles_in_timed_run"] == 0
    # --repeats 2: a second timed run per engine with its own tokens; nothing the first one cached is hit by it
    runs = [json.loads(l.split(" ", 1)[1]) for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert [(r["caching"], r["seed"]) for r in runs] == [(False, 0), (False, 2), (True, 0), (True, 2)], runs
    assert runs[3]["prefill_computed"] == runs[2]["prefill_computed"] and runs[3]["snapshot_hits"] == runs[2]["snapshot_hits"]
    assert [r["seed"] for r in result["runs"]] == [0, 2] and "median of 2 runs" in out.stdout


def test_answer_lengths_vary_unless_fixed():
    """The default draws every answer's length, so that the chats do not end their turns in the same step."""
    import argparse
    from course.bench import multiturn
    args = argparse.Namespace(conversations=8, turns=3, system_len=4, message_len=2, answer_len=64, vocab=50,
                              fixed_answers=False)
    _, _, lengths = multiturn.chats(args)
    flat = [n for per_chat in lengths for n in per_chat]
    assert min(flat) >= 32 and max(flat) <= 96 and len(set(flat)) > 8, lengths
    assert multiturn.chats(args) == multiturn.chats(args)                       # seeded: the same every run
    args.fixed_answers = True
    assert {n for per_chat in multiturn.chats(args)[2] for n in per_chat} == {64}


def test_the_results_table_fits_80_columns_and_folds_below():
    """H200-sized numbers in every cell: within 80 columns nothing is cut; a narrower terminal folds cells (as
    ./check.sh show does) instead of cutting them with "…"."""
    import io
    from rich.console import Console
    from rich.cells import cell_len
    from course.bench import multiturn
    row = dict(prompt_tokens=344576, prefill_computed=36096, snapshot_hits=12345, mean_ttft_ms=12345.6,
               p50_ttft_ms=11111.1, p90_ttft_ms=22222.2, tok_per_s=123456, seconds=1234.56)
    results = [dict(row, caching=False), dict(row, caching=True)]
    for width in (80, 60):
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(multiturn.results_table(results), soft_wrap=True)     # as the CLI's say() prints it
        text = console.export_text()
        assert max(cell_len(line) for line in text.splitlines()) <= width, text
        assert "…" not in text, text
        if width == 80:
            for value in ("344576", "36096", "12345.6", "22222.2", "123456", "1234.56", "caching", "snapshot"):
                assert value in text, (value, text)
