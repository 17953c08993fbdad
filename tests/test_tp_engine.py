"""The tensor-parallel engine on the CPU: g01's LLM(..., device="cpu", tensor_parallel_size=2), 2 ranks over gloo.

Each rank is a process (course/runtime/tp_engine.py); the reference files back every exercise. Oracle: the same
engine at TP=1 on the same checkpoint (HF transformers 5.17 save_pretrained of a tiny fp32 model, every
parameter randomised), greedy, token for token.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from checks import hf_models
from checks.kit import Rand
from course.grader import select

ROOT = Path(__file__).resolve().parent.parent
ENGINE = dict(device="cpu", max_num_seqs=4, max_model_len=128, block_size=4, max_num_batched_tokens=24,
              num_kvcache_blocks=40)


@pytest.fixture(autouse=True)
def _reference_files(monkeypatch):
    monkeypatch.setenv("COURSE_SELECTION", '{"default": "solutions"}')
    select.forget()
    select.install()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # two ranks on two cores
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _case(family: str, seed: int = 5) -> tuple[str, list[list[int]]]:
    """A tiny randomised HF checkpoint of `family` and 6 prompts."""
    r = Rand(seed)
    config = hf_models.tiny_config(family, r)
    hf = hf_models.hf_model(family, config, r)
    folder = Path(tempfile.mkdtemp(prefix=f"course-tp-{family}-"))
    if family == "qwen3_omni_moe_text":
        hf_models.omni_checkpoint(hf, folder)
    else:
        hf_models.save_hf(hf, folder)
    prompts = [r.randint(1, 96, (r.int(1, 18),)).tolist() for _ in range(6)]
    return str(folder), prompts


def _llm(folder: str, **kwargs):
    return select.load("g01_gpu_engine").LLM(folder, **{**ENGINE, **kwargs})


def _greedy(n: int = 8):
    return select.load("e01_sampling").SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_tp2_greedy_equals_tp1(family):
    """Chunked prefill (budget 24), a KV pool small enough to preempt, 4 running sequences: every token equal."""
    folder, prompts = _case(family)
    ref = [o.token_ids for o in _llm(folder).generate(prompts, _greedy())]
    with _llm(folder, tensor_parallel_size=2) as llm:
        assert torch.distributed.get_world_size() == 2
        full = sum(p.numel() for p in _llm(folder).model.parameters())
        assert sum(p.numel() for p in llm.model.parameters()) < 0.7 * full, "rank 0 should hold about half"
        outs = llm.generate(prompts, _greedy())
        pids = [w.process.pid for w in llm.tp.workers]
    assert [o.token_ids for o in outs] == ref
    assert not torch.distributed.is_initialized()
    assert all(_gone(pid) for pid in pids)


def test_abort_bad_request_and_slot_reuse_under_tp():
    """Hybrid model: a bad request is refused alone, an aborted one frees its GDN slot on every rank
    (4 slots per rank: without the release events the workers' pools run out in the later rounds)."""
    folder, prompts = _case("qwen3_5_moe_text")
    ref = [o.token_ids for o in _llm(folder).generate(prompts, _greedy())]
    with _llm(folder, tensor_parallel_size=2) as llm:
        outs = llm.generate([prompts[0], [], [5] * 200, prompts[1]], _greedy())
        assert outs[1].error and "empty" in outs[1].error and outs[2].error and "max_model_len" in outs[2].error
        assert [outs[0].token_ids, outs[3].token_ids] == ref[:2]
        for _ in range(3):                               # each round: 4 sequences start, 2 are aborted midway
            ids = [llm.add_request(p, _greedy()) for p in prompts[:4]]
            for _ in range(3):
                llm.step()
            for i in ids[:2]:
                llm.abort(i)
            while llm.has_unfinished():
                llm.step()
            assert [llm.requests.pop(i).completion_token_ids for i in ids[2:]] == ref[2:4]
        assert [o.token_ids for o in llm.generate(prompts, _greedy())] == ref
        assert not llm.runner.gdn_pool.slot_of


def test_worker_exception_is_reported_with_its_traceback():
    folder, prompts = _case("qwen3")
    llm = _llm(folder, tensor_parallel_size=2)
    pid = llm.tp.workers[0].process.pid
    llm.tp.send(__import__("numpy").array([99], dtype="int64"))        # a message kind no worker knows
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code 1\)(.|\n)*unknown message kind 99"):
        llm.generate(prompts[:2], _greedy())
    assert _gone(pid) and not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="worker rank 1"):
        llm.generate(prompts[:1], _greedy())
    llm.close()


SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
os.environ["COURSE_SELECTION"] = '{{"default": "solutions"}}'
import torch
torch.set_num_threads(1)
from course.grader import select
select.install()
g01, e01 = select.load("g01_gpu_engine"), select.load("e01_sampling")
llm = g01.LLM({folder!r}, tensor_parallel_size=2, **{engine!r})
print("WORKER", llm.tp.workers[0].process.pid, flush=True)
params = e01.SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
{body}
"""


def _script(body: str, folder: str) -> list[str]:
    code = SCRIPT.format(root=str(ROOT), folder=folder, engine={**ENGINE, "max_model_len": 512, "num_kvcache_blocks": 256},
                         body=textwrap.dedent(body))
    return [sys.executable, "-c", code]


def _start(body: str):
    folder, _ = _case("qwen3")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_script(body, folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True,   # SIGINT default: a backgrounded run inherits it ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    line = proc.stdout.readline()
    assert line.startswith("WORKER"), proc.communicate(timeout=60)
    return proc, int(line.split()[1])


def _group_left(proc) -> list[str]:
    """Live processes (not zombies) of the process group the engine's subprocess led: 'pid state' each."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == proc.pid and fields[0] != "Z":
            left.append(f"{stat.parent.name} {fields[0]}")
    return left


def _wait_group_gone(proc) -> list[str]:
    for _ in range(150):                   # up to 15 s: a loaded 2-core CI machine can be slow to reap
        left = _group_left(proc)
        if not left:
            return []
        time.sleep(0.1)
    return left


def test_killed_worker_is_reported_and_the_engine_exits():
    """SIGKILL the worker mid-generation: rank 0 names the dead rank and the whole process group is gone."""
    proc, worker = _start("""
        while True:
            llm.generate([[1, 2, 3]] * 4, params)
            print("ROUND", flush=True)
    """)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ROUND"), (line, proc.poll())
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - start < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, f"the engine exited with 0 after its worker was killed: {err[-2000:]}"
    assert "tensor parallel worker rank 1 died (exit code -9)" in err, err[-2000:]
    left = _wait_group_gone(proc)
    assert not left, f"processes of the engine's group outlived it: {left}; {err[-2000:]}"


def test_exit_without_close_and_ctrl_c_leave_no_worker():
    """The script ends without close() (atexit stops the worker); a second one gets Ctrl-C mid-generation."""
    proc, worker = _start("""
        llm.generate([[1, 2, 3]], params)
        print("DONE", flush=True)
    """)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "DONE" in out, err[-2000:]
    assert not _wait_group_gone(proc), f"a worker outlived the script: {_group_left(proc)}"
    proc, worker = _start("""
        print("GO", flush=True)
        while True:
            llm.generate([[1, 2, 3]] * 4, params)
    """)
    try:
        assert proc.stdout.readline().startswith("GO")
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)                   # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "KeyboardInterrupt" in err, err[-2000:]
    left = _wait_group_gone(proc)
    assert not left, f"a worker outlived Ctrl-C: {left}; {err[-2000:]}"


def test_a_model_that_cannot_be_split_is_refused_and_the_next_engine_starts():
    """nH = 3 over 2 ranks: every rank raises the same ValueError while building; no worker is left behind."""
    from transformers import Qwen3Config
    config = Qwen3Config(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=3,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    g01 = select.load("g01_gpu_engine")
    with pytest.raises(ValueError, match="num_attention_heads = 3 is not divisible"):
        g01.LLM(config, tensor_parallel_size=2, **ENGINE)
    from course.runtime import tp_engine
    pids = [w.process.pid for w in tp_engine._ACTIVE.workers]
    folder, prompts = _case("qwen3")
    ref = [o.token_ids for o in _llm(folder).generate(prompts[:2], _greedy())]
    with _llm(folder, tensor_parallel_size=2) as llm:            # closes the broken group first
        assert [o.token_ids for o in llm.generate(prompts[:2], _greedy())] == ref
    assert all(_gone(pid) for pid in pids) and tp_engine._ACTIVE is None


def test_hybrid_prefix_caching_at_tp2_is_refused_and_leaves_no_worker():
    """e07's snapshots hold one rank's heads only: TP > 1 with hybrid prefix caching is a clear ValueError, and the
    workers started for it are stopped."""
    folder, _ = _case("qwen3_5_text")
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
        _llm(folder, tensor_parallel_size=2, enable_prefix_caching=True)
    from course.runtime import tp_engine
    assert tp_engine._ACTIVE is None or all(_gone(w.process.pid) for w in tp_engine._ACTIVE.workers)
