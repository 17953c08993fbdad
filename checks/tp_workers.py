"""Multi-process runs for the m07 checks: every scenario on 2 (or 4) ranks (gloo on CPU), results back to the parent.

The parent (checks/test_m07_tensor_parallel.py) builds one `job` dict (inputs, full weights, tiny
configs, checkpoint folders), calls `launch(job)` once per world size (the full run at tp = 2, one small
run at tp = 4) and grades the returned per-rank results.

- Children start with the fork method on Linux (they inherit the already imported torch: about 0.3 s;
  a spawned child re-imports torch, 10-50 s on a loaded 2-core machine), elsewhere with spawn. This
  module imports no transformers, so a spawned child stays as light as possible.
- Each scenario runs in its own fresh process group (a new file store), and the ranks leave it together
  through that store: a rank that fails (or finishes without communicating) never tears its connections
  down while the other is still connecting, and a scenario that leaves one rank stuck in a collective
  cannot pair its calls with the next scenario's.
- Every scenario records its data and its exception (type, message, where in the exercise file);
  a stub's NotImplementedError is reported as such, so the parent marks the check 未实现.
- Results are written after every scenario (torch.save, atomic rename): a run cut short by the
  deadline still returns what finished.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 2
MODULE = "m07_tensor_parallel"
COLLECTIVE_TIMEOUT_S = 15      # a rank waiting for a peer that never comes gives up after this
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ parent side

def launch(job: dict, world: int = WORLD, deadline_s: float = 60.0) -> list[dict]:
    """Run every scenario of `job` on `world` ranks; one {scenario: {"data", "error"}} dict per rank."""
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    ctx = multiprocessing.get_context(method)
    with tempfile.TemporaryDirectory(prefix="course-tp-") as tmp:
        procs = [ctx.Process(target=_worker, args=(rank, world, tmp, job), daemon=True) for rank in range(world)]
        for p in procs:
            p.start()
        try:
            end = time.monotonic() + deadline_s
            for p in procs:
                p.join(max(0.1, end - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [_read(Path(tmp) / f"rank{rank}.pt") for rank in range(world)]


def _read(path: Path) -> dict:
    return torch.load(path, weights_only=False) if path.is_file() else {}


# ------------------------------------------------------------------------------------------ child side

def _worker(rank: int, world: int, tmp: str, job: dict) -> None:
    torch.set_num_threads(1)                  # 2 or 4 ranks on 2 cores; also keeps a forked child off OpenMP
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from course.grader import select
    select.install()
    results: dict = {}
    for name in job["scenarios"]:
        store = dist.FileStore(f"{tmp}/store-{name.replace(':', '-')}", world)
        data: dict = {}
        error = None
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            store.set(f"ready{rank}", "1")
            with torch.no_grad():
                SCENARIOS[name.split(":")[0]](select.load(MODULE), rank, job, name, data)
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the parent
            error = _describe(exc)
        finally:
            if error is not None and dist.is_initialized():
                _wait(store, "ready", world)          # never tear down while a peer is still connecting
                dist.destroy_process_group()          # a peer blocked in a collective fails now, not at the timeout
            _leave_together(store, rank, world)
            if dist.is_initialized():
                dist.destroy_process_group()
        results[name] = {"data": data, "error": error}
        torch.save(results, f"{tmp}/rank{rank}.tmp")
        os.replace(f"{tmp}/rank{rank}.tmp", f"{tmp}/rank{rank}.pt")


def _wait(store, key: str, world: int) -> None:
    try:
        store.wait([f"{key}{r}" for r in range(world)], timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - the peer never got there; go on and let the parent report it
        pass


def _leave_together(store, rank: int, world: int) -> None:
    """A barrier through the file store, not through gloo: it works after any error, and no rank tears its
    connections down (or starts the next scenario) while the other is still connecting or communicating."""
    store.set(f"done{rank}", "1")
    try:
        store.wait([f"done{r}" for r in range(world)], timedelta(seconds=2 * COLLECTIVE_TIMEOUT_S))
    except Exception:  # noqa: BLE001 - the other rank is gone; the parent reports the missing scenarios
        pass


def _describe(exc: BaseException) -> dict:
    """Type, message and the deepest frame inside an exercise file (impl.*) as 'file:line (Class.function)'."""
    where = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_globals.get("__name__", "").startswith("impl."):
            owner = frame.f_locals.get("self")
            name = f"{type(owner).__name__}.{frame.f_code.co_name}" if owner is not None else frame.f_code.co_name
            path = frame.f_code.co_filename
            try:
                path = str(Path(path).resolve().relative_to(ROOT))
            except ValueError:
                pass
            where = f"{path}:{lineno}（{name}）"
    return {"type": type(exc).__name__, "message": str(exc), "where": where,
            "not_implemented": isinstance(exc, NotImplementedError)}


# ------------------------------------------------------------------------------------------ scenarios

def _load(param, tensor, shard=()) -> int:
    return param.weight_loader(param, tensor, shard)


def column_row(m, rank: int, job: dict, name: str, out: dict) -> None:
    j = job[name]
    col = m.ColumnParallelLinear(j["w_col"].shape[1], j["w_col"].shape[0], bias=True)
    out["col_shape"] = tuple(col.weight.shape)
    out["col_count"] = _load(col.weight, j["w_col"]) + _load(col.bias, j["b_col"])
    out["col_y"] = col(j["x"])
    row = m.RowParallelLinear(j["w_row"].shape[1], j["w_row"].shape[0], bias=True)
    out["row_shape"] = tuple(row.weight.shape)
    out["row_count"] = _load(row.weight, j["w_row"]) + _load(row.bias, j["b_row"])
    out["row_y"] = row(j["x_row"].chunk(dist.get_world_size(), dim=-1)[rank])   # the row layer's input is already split


def qkv_merged(m, rank: int, job: dict, name: str, out: dict) -> None:
    j = job[name]
    for key in ("gqa", "gated"):
        c = j[key]
        qkv = m.QKVParallelLinear(c["hidden"], c["head_dim"], c["heads"], c["kv_heads"],
                                  q_head_size_factor=c["factor"])
        out[f"{key}_heads"] = (qkv.num_heads, qkv.num_kv_heads)
        out[f"{key}_count"] = sum(_load(qkv.weight, c[f"w_{p}"], (p,)) for p in "qkv")
        out[f"{key}_y"] = qkv(j["x"])
    merged = m.MergedColumnParallelLinear(j["x"].shape[1], [j["w_gate"].shape[0]] * 2)
    out["merged_count"] = _load(merged.weight, j["w_gate"], (0,)) + _load(merged.weight, j["w_up"], (1,))
    out["merged_y"] = merged(j["x"])


def qkv_replicated(m, rank: int, job: dict, name: str, out: dict) -> None:
    """QKVParallelLinear with nKV >= tp (the control) and nKV < tp (each KV head on tp / nKV ranks), each case on
    its own: a crash in one leaves the others to grade (none of them communicates). Records the stage it got to."""
    j = job[name]
    for key, c in j["cases"].items():
        stage = "init"
        try:
            qkv = m.QKVParallelLinear(c["hidden"], c["head_dim"], c["heads"], c["kv_heads"])
            out[f"{key}_heads"] = (qkv.num_heads, qkv.num_kv_heads)
            stage = "load"
            out[f"{key}_count"] = sum(_load(qkv.weight, c[f"w_{p}"], (p,)) for p in "qkv")
            out[f"{key}_rows"] = qkv.weight.detach().clone()
            stage = "forward"
            out[f"{key}_y"] = qkv(c["x"])
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - graded by the parent, case by case
            out[f"{key}_error"] = dict(_describe(exc), stage=stage)


def vocab(m, rank: int, job: dict, name: str, out: dict) -> None:
    j = job[name]
    vocab_size, hidden = j["weight"].shape
    emb = m.VocabParallelEmbedding(vocab_size, hidden)
    out["emb_count"], out["emb_numel"] = _load(emb.weight, j["weight"]), emb.weight.numel()
    out["emb_y"] = emb(j["ids"])
    head = m.ParallelLMHead(vocab_size, hidden, bias=True)
    out["head_count"] = _load(head.weight, j["weight"]) + _load(head.bias, j["bias"])
    out["head_numel"] = head.weight.numel() + head.bias.numel()
    out["head_y"] = head(j["hidden"])


def model(m, rank: int, job: dict, name: str, out: dict) -> None:
    """build_model -> tensor_parallel -> load_checkpoint -> logits, recording the structure on the way
    (each record as soon as it exists: a later crash still leaves the earlier ones to grade)."""
    j = job[name]
    m06, ctx_cls = select_load("m06_models"), select_load("m04_attention").AttentionContext
    net = m06.build_model(j["config"])
    out["stage"] = "tensor_parallel"              # how far the rank got: evidence for the parent's hints
    out["returned_same"] = m.tensor_parallel(net) is net
    out["numel"] = sum(p.numel() for p in net.parameters())
    attns = [layer.self_attn for layer in net.model.layers if not layer.is_linear]
    out["heads"] = [(a.num_heads, a.num_kv_heads, a.q_size, a.kv_size) for a in attns]
    out["backend_heads"] = [(a.attn.num_heads, a.attn.num_kv_heads) for a in attns]
    moe = net.model.layers[j["moe_layer"]].mlp if j["moe_layer"] is not None else None
    if moe is not None:
        out["expert_shapes"] = (tuple(moe.experts.gate_up_proj.shape), tuple(moe.experts.down_proj.shape),
                                tuple(moe.gate.weight.shape))
    out["tied"] = net.lm_head.weight is net.model.embed_tokens.weight
    gdn = net.model.layers[j["gdn_layer"]].linear_attn if j["gdn_layer"] is not None else None
    if gdn is not None:
        out["gdn_dims"] = (gdn.num_k_heads, gdn.num_v_heads, gdn.key_dim, gdn.value_dim, gdn.conv_dim)
        out["gdn_shapes"] = {n: tuple(p.shape) for n, p in gdn.named_parameters()}
        pool = select_load("e04_model_runner").GDNStatePool(net, len(j["gdn_lengths"]))
        out["pool_shapes"] = (tuple(pool.conv[j["gdn_layer"]].shape), tuple(pool.ssm[j["gdn_layer"]].shape))
    out["stage"] = "load_checkpoint"
    m06.load_checkpoint(net, j["folder"])
    out["stage"] = "forward"
    out["qkv_local"] = attns[0].qkv_proj.weight.detach().clone()
    if moe is not None:
        out["expert_local"] = (moe.experts.gate_up_proj[0].clone(), moe.experts.down_proj[0].clone())
        out["moe_probe"] = moe(j["probe"])
    if gdn is not None:
        out["gdn_local"] = {n: p.detach().clone() for n, p in gdn.named_parameters()}
        out["gdn_steps"] = gdn_steps(gdn, pool.conv[j["gdn_layer"]], pool.ssm[j["gdn_layer"]], j)
    ctx = ctx_cls.from_seqlens(j["lengths"])
    out["logits"] = net.compute_logits(net(j["ids"], j["positions"], ctx))


def gdn_steps(gdn, conv, ssm, j: dict) -> tuple:
    """One GatedDeltaNet layer with its state in a GDNStatePool's tensors: a packed prefill of j["gdn_lengths"]
    tokens (j["gdn_x"]), then one decode token per sequence (j["gdn_next"]). Returns both outputs."""
    state_cls = select_load("m05_gated_deltanet").GDNState
    lengths = j["gdn_lengths"]
    state = state_cls(conv=conv[:len(lengths)], ssm=ssm[:len(lengths)])       # views: updated in place
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    prefill = gdn(j["gdn_x"], cu, state)
    decode = gdn(j["gdn_next"], torch.arange(len(lengths) + 1, dtype=torch.int32), state)
    return prefill, decode


def card(m, rank: int, job: dict, name: str, out: dict) -> None:
    """The card's worked example: Column(2 -> 4) then Row(4 -> 2, bias); QKV rows; vocab shards of V = 5;
    Gated DeltaNet rows (nk = 2, nv = 4); a single KV head over 2 ranks."""
    j = job[name]
    col, row = m.ColumnParallelLinear(2, 4), m.RowParallelLinear(4, 2, bias=True)
    _load(col.weight, j["w1"]), _load(row.weight, j["w2"]), _load(row.bias, j["b2"])
    out["h"] = col(j["x"])
    out["y"] = row(out["h"])                     # no communication between the two layers
    qkv = m.QKVParallelLinear(1, 1, 4, 2)
    for p in "qkv":
        _load(qkv.weight, j[f"rows_{p}"], (p,))
    out["qkv_rows"] = qkv.weight[:, 0].clone()
    emb = m.VocabParallelEmbedding(5, 1)
    _load(emb.weight, j["emb"])
    out["emb_y"] = emb(j["ids"])
    rows = torch.arange(8.0)                     # Gated DeltaNet nk = 2, nv = 4, dk = dv = 1: q 0 1 | k 2 3 | v 4..7
    qkv = m.MergedColumnParallelLinear(1, [2, 2, 4])
    _load(qkv.weight, rows[:, None])
    conv = m.ParallelConv1d([2, 2, 4], 1)
    _load(conv.weight, rows[:, None, None])
    out["gdn_rows"] = (qkv.weight[:, 0].clone(), conv.weight[:, 0, 0].clone())
    kv1 = m.QKVParallelLinear(1, 1, 2, 1)        # nH = 2, nKV = 1: q 0 1 | k 2 | v 3
    for p, t in (("q", rows[:2]), ("k", rows[2:3]), ("v", rows[3:4])):
        _load(kv1.weight, t[:, None], (p,))
    out["kv1_rows"] = kv1.weight[:, 0].clone()


def select_load(module: str):
    from course.grader import select
    return select.load(module)


SCENARIOS = {"column_row": column_row, "qkv_merged": qkv_merged, "qkv_replicated": qkv_replicated, "vocab": vocab,
             "model": model, "card": card}
