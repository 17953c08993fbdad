"""What the paged prefill pays for its block table: k02's reference kernel with one change at a time.

    python -m course.bench.k02_paging [--json FILE]        (GPU; about three minutes on an H200)

`./check.sh bench k02` reports the paged prefill at 1.1-1.2x the unpaged kernel. This study times the reference
(`solutions/k02_paged_attention.py`) paged and unpaged on the bench's prefill shapes at page sizes 16 and 256, and
variants that each change one thing (edits of the reference's text, each run in its own process with that file
selected): the software pipeline's depth, one block-table load per page instead of per key, the next tile's rows or
its K/V loaded one tile ahead. `--ttgir` also counts, in the compiled TTGIR of each prefill kernel, the asynchronous
global-to-shared copies that Triton's software pipeliner emits for loads it can issue a tile ahead.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from ..grader import select
from .common import machine_info, time_cycled

REFERENCE = select.ROOT / "solutions" / "k02_paged_attention.py"
SHAPES = ((8, 1024), (16, 512), (64, 128))        # sequences x length: 8k tokens, as ./check.sh bench k02
PAGES = (16, 256)
NH, NKV, D = 32, 8, 128

_TILE_SIG = "def _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt_ptr, n0, Lk,"
_TILE_LOAD = """    rows = _key_rows(bt_ptr, j, Lk, PAGE, PAGED)
    kv_mask = (j < Lk)[:, None] & (offs_d < D)[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)   # [N, D]
    v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
"""
_ACC_INIT = "    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)\n"
_CALL = "acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, seq_keys, n0, Lk,"
_LOAD_KV = '''@triton.jit
def _load_kv(k_ptr, v_ptr, bt_ptr, j, Lk, offs_d, stride_kt, stride_vt, D, PAGE: tl.constexpr, PAGED: tl.constexpr):
    rows = _key_rows(bt_ptr, j, Lk, PAGE, PAGED)
    kv_mask = (j < Lk)[:, None] & (offs_d < D)[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_tile('''

# name -> (what it changes, [(old, new, count)]); every old text must occur exactly `count` times in the reference
VARIANTS = {
    "reference": ("num_stages 2", []),
    "stages3": ("num_stages 3 (the software pipeline one tile deeper)",
                [("    return m, n, warps, 2\n", "    return m, n, warps, 3\n", 1)]),
    "stages4": ("num_stages 4", [("    return m, n, warps, 2\n", "    return m, n, warps, 4\n", 1)]),
    "table_per_page": ("one block-table load per page of the tile (BLOCK_N / P entries) instead of one per key", [
        ("        block = tl.load(bt_ptr + j // PAGE, mask=j < Lk, other=0).to(tl.int64)   # bt_ptr: this sequence's row\n"
         "        return block * PAGE + j % PAGE\n",
         "        NP: tl.constexpr = BLOCK_N // PAGE if PAGE < BLOCK_N else 1\n"
         "        P_IN: tl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N\n"
         "        n0 = tl.min(j, axis=0)\n"
         "        p = n0 // PAGE + tl.arange(0, NP)\n"
         "        blocks = tl.load(bt_ptr + p, mask=p * PAGE < Lk, other=0).to(tl.int64)\n"
         "        first = blocks[:, None] * PAGE + (n0 % PAGE if PAGE >= BLOCK_N else 0) + tl.arange(0, P_IN)[None, :]\n"
         "        return tl.reshape(first, [BLOCK_N])\n", 1),
        ("def _key_rows(bt_ptr, j, Lk, PAGE: tl.constexpr, PAGED: tl.constexpr):",
         "def _key_rows(bt_ptr, j, Lk, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):", 1),
        ("_key_rows(bt_ptr, j, Lk, PAGE, PAGED)", "_key_rows(bt_ptr, j, Lk, PAGE, PAGED, BLOCK_N)", 1)]),
    "rows_ahead": ("the next tile's key rows (its block-table loads) computed one tile ahead, carried by the loop", [
        (_TILE_SIG, _TILE_SIG.replace("n0, Lk,", "n0, rows, Lk,"), 1),
        ("    rows = _key_rows(bt_ptr, j, Lk, PAGE, PAGED)\n",
         "    rows_next = _key_rows(bt_ptr, j + BLOCK_N, Lk, PAGE, PAGED)\n", 1),
        ("    return acc, m_new, l_i\n", "    return acc, m_new, l_i, rows_next\n", 1),
        (_ACC_INIT, _ACC_INIT + "    rows = _key_rows(seq_keys, tl.arange(0, BLOCK_N), Lk, PAGE, PAGED)\n", 1),
        (_CALL, _CALL.replace("acc, m_i, l_i =", "acc, m_i, l_i, rows =").replace("n0, Lk,", "n0, rows, Lk,"), 2)]),
    "kv_ahead": ("the next tile's K and V loaded one tile ahead into registers, carried by the loop", [
        ("@triton.jit\ndef _attend_tile(", _LOAD_KV, 1),
        (_TILE_SIG, _TILE_SIG.replace("l_i, k_ptr", "l_i, k, v, k_ptr"), 1),
        (_TILE_LOAD, "    k_next, v_next = _load_kv(k_ptr, v_ptr, bt_ptr, j + BLOCK_N, Lk, offs_d, stride_kt, stride_vt, "
                     "D, PAGE, PAGED)\n", 1),
        ("    return acc, m_new, l_i\n", "    return acc, m_new, l_i, k_next, v_next\n", 1),
        (_ACC_INIT, _ACC_INIT + "    k, v = _load_kv(k_ptr, v_ptr, seq_keys, tl.arange(0, BLOCK_N), Lk, offs_d, stride_kt, "
                                "stride_vt, D, PAGE, PAGED)\n", 1),
        (_CALL, _CALL.replace("acc, m_i, l_i =", "acc, m_i, l_i, k, v =").replace("l_i, k_ptr", "l_i, k, v, k_ptr"), 2)]),
}


def variant_source(name: str) -> str:
    text = REFERENCE.read_text()
    for old, new, count in VARIANTS[name][1]:
        if text.count(old) != count:
            raise SystemExit(f"k02_paging: variant {name}: the reference no longer holds {old[:60]!r} {count} time(s)")
        text = text.replace(old, new)
    return text


def _problem(num_seqs: int, length: int, page: int, gen):
    import torch
    from .kernels import _gather, _paged
    lens = [length] * num_seqs
    q = torch.randn(num_seqs * length, NH, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    kc, vc, tables = _paged(lens, NKV, D, page, torch.bfloat16, gen)
    return q, kc, vc, tables, _gather(kc, tables, lens, page), _gather(vc, tables, lens, page)


def measure(name: str, replays: int) -> list[dict]:
    """Time the variant `name` (selected as k02's file in this process) on every shape and page size."""
    import torch
    m = select.load("k02_paged_attention")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for page in PAGES:
        for num_seqs, length in SHAPES:
            total = num_seqs * length
            cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
            touched = 2 * total * NH * D * 2 + 2 * total * NKV * D * 2
            sets = [_problem(num_seqs, length, page, gen) for _ in range(4)]
            scale = D ** -0.5
            tu = time_cycled(lambda i: (lambda s=sets[i % 4]: m.flash_attention_varlen(
                s[0], s[4], s[5], cu, cu, length, scale)), touched, replays=replays)
            tp = time_cycled(lambda i: (lambda s=sets[i % 4]: m.prefill_attention(
                s[0], s[1], s[2], cu, cu, s[3], length, scale)), touched, replays=replays)
            q, kc, vc, tables, k, v = sets[0]
            same = torch.equal(m.flash_attention_varlen(q, k, v, cu, cu, length, scale),
                               m.prefill_attention(q, kc, vc, cu, cu, tables, length, scale))
            unpaged, paged = [x * 1e3 for x in tu.ms], [x * 1e3 for x in tp.ms]
            rows.append(dict(variant=name, page=page, seqs=num_seqs, length=length, shape=f"{num_seqs} x {length}",
                             unpaged_us=unpaged, paged_us=paged, paged_equals_unpaged=same,
                             unpaged_median_us=_median(unpaged), unpaged_min_us=min(unpaged),
                             unpaged_max_us=max(unpaged), paged_median_us=_median(paged), paged_min_us=min(paged),
                             paged_max_us=max(paged), ratio=_median(paged) / _median(unpaged)))
            del sets
    return rows


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def async_copies(name: str, paged: bool) -> dict:
    """Compile the variant's prefill kernel (paged or not) into a fresh Triton cache; count its async copies."""
    import torch
    m = select.load("k02_paged_attention")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, kc, vc, tables, k, v = _problem(8, 1024, 16, gen)
    cu = torch.arange(0, 8193, 1024, dtype=torch.int32, device="cuda")
    if paged:
        m.prefill_attention(q, kc, vc, cu, cu, tables, 1024, D ** -0.5)
    else:
        m.flash_attention_varlen(q, k, v, cu, cu, 1024, D ** -0.5)
    torch.cuda.synchronize()
    found = glob.glob(f"{os.environ['TRITON_CACHE_DIR']}/**/_prefill_kernel.ttgir", recursive=True)
    if len(found) != 1:
        return dict(error=f"{len(found)} compiled _prefill_kernel in the cache")
    ttgir = Path(found[0]).read_text()
    ptx = Path(found[0]).with_suffix(".ptx").read_text()
    return dict(async_copies_ttgir=len(re.findall(r"async_copy_global_to_local", ttgir)),
                cp_async_ptx=len(re.findall(r"cp\.async\.", ptx)), loads_ttgir=len(re.findall(r"tt\.load", ttgir)))


def _child(argv: list[str]) -> None:
    """One process per variant: its edited file is selected as k02 before anything imports it."""
    what, name, path = argv[:3]
    os.environ[select.ENV] = select.encode({"default": "solutions", "k02_paged_attention": path})
    import torch
    with torch.inference_mode():
        out = measure(name, int(argv[3])) if what == "time" else async_copies(name, argv[3] == "paged")
    print("K02_PAGING " + json.dumps(out), flush=True)


def _run_child(args: list[str], env: dict | None = None):
    r = subprocess.run([sys.executable, "-m", "course.bench.k02_paging", "--child", *args], capture_output=True,
                       text=True, env=env, cwd=select.ROOT)
    for line in r.stdout.splitlines():
        if line.startswith("K02_PAGING "):
            return json.loads(line[len("K02_PAGING "):])
    raise SystemExit(f"k02_paging: {' '.join(args[:2])} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m course.bench.k02_paging", description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--ttgir", action="store_true", help="also count the async copies in the compiled kernels")
    ap.add_argument("--json", help="write the per-replay times, the command and the machine to this file")
    opts = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("python -m course.bench.k02_paging：需要 GPU（CUDA）。")
        return 1
    result = dict(command=shlex.join(["python", "-m", "course.bench.k02_paging", *argv]), machine=machine_info(),
                  reference=str(REFERENCE.relative_to(select.ROOT)), variants={}, rows=[], ttgir=[])
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.variants:
            path = Path(tmp) / f"k02_{name}.py"
            path.write_text(variant_source(name))
            result["variants"][name] = VARIANTS[name][0]
            print(f"{name}: {VARIANTS[name][0]}", flush=True)
            for row in _run_child(["time", name, str(path), str(opts.replays)]):
                result["rows"].append(row)
                u, p = row["unpaged_median_us"], row["paged_median_us"]
                print(f"  P {row['page']:3d}  {row['seqs']:2d} x {row['length']:4d}: unpaged {u:6.1f} µs "
                      f"[{min(row['unpaged_us']):.1f}–{max(row['unpaged_us']):.1f}]  paged {p:6.1f} µs "
                      f"[{min(row['paged_us']):.1f}–{max(row['paged_us']):.1f}]  paged/unpaged {p / u:.3f}"
                      f"{'' if row['paged_equals_unpaged'] else '  (outputs differ!)'}", flush=True)
            if opts.ttgir:
                for paged in (False, True):
                    env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tmp) / f"cache_{name}_{paged}"))
                    counts = _run_child(["ttgir", name, str(path), "paged" if paged else "unpaged"], env)
                    result["ttgir"].append(dict(variant=name, paged=paged, kernel="paged" if paged else "unpaged",
                                                **counts))
                    print(f"  {'paged  ' if paged else 'unpaged'} kernel: {counts}", flush=True)
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
