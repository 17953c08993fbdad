"""Tensor parallel for the engine: `LLM(model, tensor_parallel_size=N)` runs one process per rank.

    rank 0: the caller's process                     ranks 1 .. N-1: workers started here
    ----------------------------------------------   ------------------------------------------------
    the same LLM class, built the same way: the full model (a folder, or a config with dummy weights
    from the same seed), m07's tensor_parallel, every full tensor through its weight_loader (shard()),
    then this rank's runner (e04 ModelRunner on the CPU / gloo, g01 GPUModelRunner on cuda:rank / NCCL,
    with its own KV cache, GDN state pool and CUDA graphs)
    scheduler + block manager; each step():           loop: receive a step -> runner.run(step's sequences)
      schedule -> send the batch ---- pipe ---->
      runner.run(batch)  <---- all-reduce / all-gather inside m07's layers ---->  runner.run(batch)
      sample: only rank 0's tokens count                (workers compute the logits, sample nothing)

What a worker receives per step is the scheduled batch as ONE flat int64 array (no pickle on the hot path):

    [STEP, R, B, released seq ids (R), per sequence (B x 6): seq_id, num_tokens, num_prompt_tokens,
     num_cached_tokens, num_scheduled_tokens, len(block_table); the token ids computed this step; the block tables]

and turns it into lightweight sequences (ShadowSequence) for its own runner, so the learner's e04 / g01
runner runs unchanged on every rank. A worker's GDN pool gives a sequence a slot the first time it sees
it (its prefill starts); "released" carries the sequences rank 0 finished, aborted or preempted since the
previous step, so every rank frees the same slots.

Transport: one pipe per worker (multiprocessing.Pipe, raw bytes through send_bytes: no pickle). The copy
through the pipe is a few hundred KB at most (a decode step of 256 sequences: their block tables), it
never races with the next step (shared memory would need an acknowledgement per step, because rank 0 may
finish a step without waiting for the workers' GPU work), and end-of-file on the pipe is how a worker
learns that rank 0 is gone.

Shutdown and failures:
- LLM.close() / `with LLM(...)` / interpreter exit (atexit): STOP to every worker, join, destroy the group.
- A worker that raises sends its traceback to rank 0 and exits; rank 0's watchdog thread notices any worker
  that exits (exit code, traceback) and kills the others. On the CPU (gloo) rank 0's pending collective then
  fails and the step raises RuntimeError("tensor parallel worker rank k died (exit code c) ..."); on GPUs an
  NCCL collective would wait forever, so if rank 0 is still inside a step 10 s later the watchdog prints the
  message and ends the process (os._exit(1)).
- An exception or Ctrl-C in rank 0 during a step kills the workers (they would wait in a collective) and is
  re-raised. Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group: rank 0 decides),
  die with rank 0 (PR_SET_PDEATHSIG and a parent check) and exit at end-of-file on their pipe.

Processes start with fork on a CPU (Linux: the worker inherits the imported modules, about 0.3 s instead of
seconds of imports) and with spawn on CUDA (a CUDA context cannot cross a fork). TP=1 never imports this module.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist

STEP, STOP, CALL = 1, 2, 3
FIELDS = 6                     # per sequence: seq_id, num_tokens, num_prompt_tokens, cached, scheduled, blocks
GRACE_S = 10.0                 # a dead worker and rank 0 still inside the step after this: exit the process
TIMEOUT = timedelta(minutes=10)

_WORKER: dict | None = None    # set in a worker process before it builds its LLM
_ACTIVE: "Rank0 | None" = None


# ----------------------------------------------------------------------------------- both roles

class TensorParallel:
    """This process's place in the group: Rank0 (the engine) or Worker; g01's LLM only uses this surface."""
    rank: int
    world_size: int
    device: torch.device

    @staticmethod
    def start(llm_cls: type, world_size: int, device: torch.device, model, kwargs: dict) -> "TensorParallel":
        """Rank 0: start the workers and join the process group. In a worker: join as its rank."""
        if _WORKER is not None:
            return Worker(_WORKER)
        return Rank0(llm_cls, world_size, device, model, kwargs)

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model with its full weights loaded -> this rank's shard (see shard_loaded)."""
        return shard_loaded(model)

    def attach(self, runner):
        raise NotImplementedError

    def close(self) -> None:
        pass


def _init_group(rank: int, world_size: int, store_path: str, device: torch.device) -> torch.device:
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=TIMEOUT)
    return device


def _shards(name: str, param: torch.Tensor) -> list[tuple]:
    """The checkpoint shards (m06's map_checkpoint_key protocol) that make up a full packed parameter."""
    if name.endswith("experts.gate_up_proj"):
        return [("expert", e, part) for e in range(param.shape[0]) for part in ("gate", "up")]
    if name.endswith("experts.down_proj"):
        return [("expert", e, "down") for e in range(param.shape[0])]
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    return {"qkv_proj": [("q",), ("k",), ("v",)], "gate_up_proj": [(0,), (1,)]}.get(module, [()])


@torch.no_grad()
def shard_loaded(model: torch.nn.Module) -> torch.nn.Module:
    """m07's tensor_parallel on a model whose FULL weights are loaded, then every full tensor (split the way a
    checkpoint stores it, m06's shard_view) through the new parameters' weight_loader: this rank keeps its
    slices. Every rank built the same full model (same folder, or dummy weights from the same seed), so
    the shards fit together exactly as if they had been loaded from a checkpoint."""
    from course.grader import select
    m06, m07 = select.load("m06_models"), select.load("m07_tensor_parallel")
    pieces = [(name, shard, m06.shard_view(model, name, p.data, shard))
              for name, p in model.named_parameters() for shard in _shards(name, p)]
    first = next(model.parameters())
    default = torch.get_default_dtype()
    torch.set_default_dtype(first.dtype)          # the new layers' empty parameters: right dtype, right device
    try:
        with torch.device(first.device):
            m07.tensor_parallel(model)
    finally:
        torch.set_default_dtype(default)
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    for name, shard, full in pieces:
        param = params[name]
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            filled[name] += loader(param, full, shard)
        elif not shard and param.shape == full.shape:      # replicated: norms, the MoE router
            param.data.copy_(full)
            filled[name] += param.numel()
        else:
            raise RuntimeError(f"{name}{list(shard)}: {list(full.shape)} does not fit {list(param.shape)} "
                               "and the parameter has no weight_loader")
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise RuntimeError(f"tensor parallel: {missing[0]} got {filled[missing[0]]} of {params[missing[0]].numel()} values")
    del pieces
    if first.device.type == "cuda":
        torch.cuda.empty_cache()
    return model


# ----------------------------------------------------------------------------------- the step message

def encode_step(seqs, released: list[int]) -> np.ndarray:
    """The scheduled batch as one int64 array (layout in the module docstring)."""
    rows = [(s.seq_id, s.num_tokens, s.num_prompt_tokens, s.num_cached_tokens, s.num_scheduled_tokens,
             len(s.block_table)) for s in seqs]
    window = chain.from_iterable(s.token_ids[s.num_cached_tokens:s.num_cached_tokens + s.num_scheduled_tokens]
                                 for s in seqs)
    tables = chain.from_iterable(s.block_table for s in seqs)
    head = np.array([STEP, len(released), len(seqs), *released], dtype=np.int64)
    return np.concatenate([head, np.array(rows, dtype=np.int64).reshape(-1),
                           np.fromiter(window, dtype=np.int64), np.fromiter(tables, dtype=np.int64)])


class _Window:
    """A sequence's token ids as a worker knows them: positions start .. start + len(ids) only."""
    __slots__ = ("start", "ids", "length")

    def __init__(self, start: int, ids: list[int], length: int):
        self.start, self.ids, self.length = start, ids, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(self.length)
            if hi <= lo:
                return []
            if step == 1 and self.start <= lo and hi <= self.start + len(self.ids):
                return self.ids[lo - self.start:hi - self.start]
        else:
            i = key + self.length if key < 0 else key
            if self.start <= i < self.start + len(self.ids):
                return self.ids[i - self.start]
        raise IndexError(f"token ids {key!r}: a tensor-parallel worker only receives the tokens computed this step "
                         f"(positions {self.start} .. {self.start + len(self.ids) - 1})")


class ShadowSequence:
    """What a worker's runner reads of a sequence: rank 0's counters and block table, and the token ids of
    this step (a decode step ships one token per sequence, not the history). Samples nothing."""
    params = None                 # a greedy SamplingParams, set once per worker

    def __init__(self, seq_id: int, num_tokens: int, num_prompt_tokens: int, num_cached_tokens: int,
                 num_scheduled_tokens: int, window: list[int], block_table: list[int], finished: bool = False):
        self.seq_id, self.num_tokens, self.num_prompt_tokens = seq_id, num_tokens, num_prompt_tokens
        self.num_cached_tokens, self.num_scheduled_tokens = num_cached_tokens, num_scheduled_tokens
        self.token_ids = _Window(num_cached_tokens, window, num_tokens)
        self.block_table = block_table
        self.sampling_params = ShadowSequence.params
        self.is_finished = finished

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def last_token(self) -> int:
        return self.token_ids[self.num_tokens - 1]


def decode_step(msg: np.ndarray) -> tuple[list[int], list[ShadowSequence]]:
    """encode_step's array -> (released seq ids, the batch's sequences)."""
    num_released, batch = int(msg[1]), int(msg[2])
    at = 3 + num_released
    released = msg[3:at].tolist()
    rows = msg[at:at + FIELDS * batch].reshape(batch, FIELDS).tolist()
    at += FIELDS * batch
    window_len = sum(r[4] for r in rows)
    window, tables = msg[at:at + window_len].tolist(), msg[at + window_len:].tolist()
    seqs, w, t = [], 0, 0
    for seq_id, num_tokens, num_prompt, cached, scheduled, blocks in rows:
        seqs.append(ShadowSequence(seq_id, num_tokens, num_prompt, cached, scheduled, window[w:w + scheduled],
                                   tables[t:t + blocks]))
        w, t = w + scheduled, t + blocks
    return released, seqs


def _no_sampling(logits: torch.Tensor, params: list, generators: list) -> torch.Tensor:
    """A worker's sampler: the logits were computed (the LM head's all-gather needs every rank); rank 0 samples."""
    return torch.zeros(len(params), dtype=torch.long, device=logits.device)


# ----------------------------------------------------------------------------------- rank 0

class _Proc:
    def __init__(self, rank: int, process, cmd, report):
        self.rank, self.process, self.cmd, self.report = rank, process, cmd, report


class Rank0(TensorParallel):
    """The engine's side: starts and watches the workers, sends each step, shuts everything down."""

    def __init__(self, llm_cls: type, world_size: int, device: torch.device, model, kwargs: dict):
        global _ACTIVE
        if isinstance(model, torch.nn.Module):
            raise ValueError("tensor_parallel_size > 1 needs a model folder or an HF config: every rank builds "
                             "and shards the model itself")
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} CUDA devices, "
                             f"{torch.cuda.device_count()} visible")
        if _ACTIVE is not None:           # one default process group per process: an engine left open goes first
            print("tensor parallel: closing the previous tensor-parallel engine of this process", file=sys.stderr)
            _ACTIVE.close()
        self.rank, self.world_size = 0, world_size
        self.failure: str | None = None
        self.closed = self._closing = False
        # where rank 0 may wait in a collective for a worker: "build" (until attach) or "step"
        self._phase: str | None = "build"
        self._ctor = getattr(llm_cls.__init__, "__code__", None)
        self._main = threading.get_ident()
        self._lock = threading.Lock()
        self._messages: dict[int, str] = {}
        self._tmp = tempfile.mkdtemp(prefix="course-tp-")
        store = os.path.join(self._tmp, "store")
        method = os.environ.get("COURSE_TP_START") or ("spawn" if device.type == "cuda" or sys.platform != "linux"
                                                       else "fork")
        ctx = multiprocessing.get_context(method)
        spec = dict(cls=(llm_cls.__module__, llm_cls.__qualname__), model=model, kwargs=dict(kwargs),
                    device=str(device), world_size=world_size, selection=os.environ.get("COURSE_SELECTION"))
        main_thread = threading.current_thread() is threading.main_thread()
        self.workers: list[_Proc] = []
        for rank in range(1, world_size):
            cmd_recv, cmd_send = ctx.Pipe(duplex=False)
            report_recv, report_send = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker_main, name=f"tp-worker-{rank}", daemon=True,
                                  args=(rank, store, cmd_recv, report_send, spec, os.getpid(), main_thread))
            process.start()
            cmd_recv.close()
            report_send.close()
            self.workers.append(_Proc(rank, process, cmd_send, report_recv))
        _ACTIVE = self
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        try:
            self.device = _init_group(0, world_size, store, device)
        except BaseException:
            self.abort()
            raise

    def attach(self, runner):
        """Wait until every worker has built its runner; rank 0's runner wrapped to send each step first."""
        self._phase = None
        blocks = [getattr(runner, "num_blocks", None)]
        waiting = {w.report: w for w in self.workers}
        while waiting:
            ready = multiprocessing.connection.wait(list(waiting) + [w.process.sentinel for w in waiting.values()],
                                                    timeout=1.0)
            for obj in ready:
                w = waiting.get(obj)
                try:
                    kind, value = w.report.recv() if w is not None and not self.failure else ("died", None)
                except EOFError:                               # it exited without a word
                    kind, value = "died", None
                if kind != "ready":                            # an error while building, or the process is gone
                    self.failure = self.failure or (
                        f"tensor parallel worker rank {w.rank} failed while building:\n{value}" if kind == "error"
                        else self._dead_message(self._dead_worker(1.0)))
                    self.abort()
                    raise RuntimeError(self.failure)
                blocks.append(value)
                del waiting[obj]
        return Rank0Runner(runner, self, min(blocks) if blocks[0] is not None else None)

    # -------------------------------------------------------------- one step
    @contextmanager
    def step(self):
        """Around everything rank 0 does for one step: a failure anywhere ends the group and names its cause."""
        if self.failure:
            raise RuntimeError(self.failure)
        if self.closed:
            raise RuntimeError("this tensor-parallel engine was closed")
        self._phase = "step"
        try:
            yield
        except KeyboardInterrupt:
            self.abort()
            raise
        except BaseException as exc:
            dead = self._dead_worker(3.0)       # a collective fails at once; the watchdog may not know yet
            if dead is not None and not self.failure:
                self.failure = self._dead_message(dead)
            self.abort()
            if self.failure:
                raise RuntimeError(self.failure) from exc
            raise
        finally:
            self._phase = None

    def send(self, msg: np.ndarray) -> None:
        data = memoryview(msg).cast("B")
        for w in self.workers:
            w.cmd.send_bytes(data)

    def call(self, fn, *args):
        """fn(runner, *args) on every rank at once (fn importable by name: it is pickled); rank 0's result.
        Off the hot path: for measurements that need every rank (a graph replay, a timed all-reduce)."""
        payload = np.array([CALL], dtype=np.int64).tobytes() + pickle.dumps((fn, args))
        with self.step():
            for w in self.workers:
                w.cmd.send_bytes(payload)
            return fn(self.runner_inner, *args)

    # -------------------------------------------------------------- failures and shutdown
    def _dead_worker(self, timeout: float) -> _Proc | None:
        end = time.monotonic() + timeout
        while True:
            for w in self.workers:
                if not w.process.is_alive():
                    return w
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    def _dead_message(self, w: _Proc | None) -> str:
        """'tensor parallel worker rank k died (exit code c)' and the worker's traceback when it sent one."""
        if w is None:
            return "a tensor parallel worker stopped"
        with self._lock:                             # the watchdog and the main thread may both ask
            if w.rank not in self._messages:
                w.process.join(1.0)
                msg = f"tensor parallel worker rank {w.rank} died (exit code {w.process.exitcode})"
                try:
                    if w.report.poll(0.5):
                        kind, value = w.report.recv()
                        if kind == "error":
                            msg += f"; its traceback:\n{value}"
                except (EOFError, OSError):
                    pass
                self._messages[w.rank] = msg
            return self._messages[w.rank]

    def _stuck(self) -> bool:
        """Is the main thread where a dead worker leaves it waiting: inside a step, or still building the LLM?"""
        if self._phase == "step":
            return True
        if self._phase != "build":
            return False
        frame = sys._current_frames().get(self._main)
        while frame is not None:
            if frame.f_code is self._ctor:
                return True
            frame = frame.f_back
        return False

    def _watch(self) -> None:
        """Watchdog thread: the first worker that exits while the group is open ends the group."""
        sentinels = {w.process.sentinel: w for w in self.workers}
        while not self._closing:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if not ready or self._closing:
                continue
            w = sentinels[ready[0]]
            message = self._dead_message(w)
            if not self.failure:
                self.failure = message
            self._kill_workers()
            deadline = time.monotonic() + GRACE_S
            while self._stuck() and not self._closing and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._stuck() and not self._closing:     # waiting in a collective that will never complete
                print(f"{self.failure}\nrank 0 is waiting in a collective for it; exiting.", file=sys.stderr, flush=True)
                os._exit(1)
            return

    def _kill_workers(self) -> None:
        for w in self.workers:
            if w.process.is_alive():
                w.process.kill()
        for w in self.workers:
            w.process.join(5)

    def abort(self) -> None:
        """Kill the workers at once (they may be waiting in a collective) and leave the group; leaving a broken
        NCCL group can block, so it gets 10 s in a helper thread."""
        self._closing = True
        self._kill_workers()
        self._finish(timeout=GRACE_S)

    def close(self) -> None:
        """STOP to every worker, wait for them, leave the process group. Safe to call twice."""
        if self.closed:
            return
        self._closing = True
        stop = np.array([STOP], dtype=np.int64).tobytes()
        for w in self.workers:
            try:
                w.cmd.send_bytes(stop)
            except OSError:
                pass
        for w in self.workers:
            w.process.join(10)
        self._kill_workers()
        self._finish()

    def _finish(self, timeout: float | None = None) -> None:
        global _ACTIVE
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            for conn in (w.cmd, w.report):
                conn.close()
        if dist.is_initialized():
            leave = threading.Thread(target=_destroy_group, name="tp-leave", daemon=True)
            leave.start()
            leave.join(timeout)
            if leave.is_alive():
                print("tensor parallel: leaving the process group did not finish (a peer died inside a collective)",
                      file=sys.stderr, flush=True)
        shutil.rmtree(self._tmp, ignore_errors=True)
        if _ACTIVE is self:
            _ACTIVE = None


class Rank0Runner:
    """Rank 0's runner with the step sent to the workers first; everything else is the runner's own."""

    def __init__(self, runner, tp: Rank0, num_blocks: int | None):
        self.inner, self.tp = runner, tp
        tp.runner_inner = runner
        if num_blocks is not None:
            self.num_blocks = num_blocks            # the fewest KV blocks any rank could allocate
        self._live: set[int] = set()                # sequences the workers have seen and not yet released
        self._released: list[int] = []

    def run(self, seqs) -> list[int]:
        msg = encode_step(seqs, self._released)
        with self.tp.step():
            self.tp.send(msg)
            self._released = []
            self._live.update(s.seq_id for s in seqs)
            return self.inner.run(seqs)

    def release(self, seq) -> None:
        self.inner.release(seq)
        if seq.seq_id in self._live:
            self._live.discard(seq.seq_id)
            self._released.append(seq.seq_id)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _destroy_group() -> None:
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group: nothing more to release
        pass


def _close_active() -> None:
    if _ACTIVE is not None:
        _ACTIVE.close()


atexit.register(_close_active)


# ----------------------------------------------------------------------------------- workers

class Worker(TensorParallel):
    """A worker's side inside its LLM: join the group; attach() reports the runner ready."""

    def __init__(self, info: dict):
        self.rank, self.world_size, self.info = info["rank"], info["world_size"], info
        self.device = _init_group(self.rank, self.world_size, info["store"], torch.device(info["device"]))

    def attach(self, runner):
        self.info["report"].send(("ready", getattr(runner, "num_blocks", None)))
        return runner


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """A worker must not outlive rank 0, even when it is stuck in a collective."""
    if use_pdeathsig and sys.platform == "linux":      # the kernel kills us when the parent thread exits
        try:
            import ctypes
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)
    watch_thread = threading.Thread(target=watch, name="tp-parent-check", daemon=True)
    if os.getppid() != parent_pid:
        os._exit(1)
    watch_thread.start()


def _worker_main(rank: int, store: str, cmd, report, spec: dict, parent_pid: int, main_thread: bool) -> None:
    global _WORKER
    _die_with_parent(parent_pid, main_thread)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        if spec["device"] == "cpu":
            torch.set_num_threads(1)               # N ranks share the cores; a forked child stays off OpenMP
        if spec["selection"] is not None:
            os.environ["COURSE_SELECTION"] = spec["selection"]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if root not in sys.path:
            sys.path.insert(0, root)
        from course.grader import select
        select.install()
        module, qualname = spec["cls"]
        if module.startswith(select.PACKAGE + "."):
            mod = select.load(module.split(".", 1)[1])
        else:
            import importlib
            mod = importlib.import_module(module)
        cls = mod
        for part in qualname.split("."):
            cls = getattr(cls, part)
        _WORKER = dict(rank=rank, world_size=spec["world_size"], store=store, device=spec["device"], report=report)
        llm = cls(spec["model"], device=spec["device"], tensor_parallel_size=spec["world_size"], **spec["kwargs"])
        ShadowSequence.params = select.load("e01_sampling").SamplingParams(temperature=0.0)
        if _serve(llm.runner, cmd) and dist.is_initialized():
            dist.destroy_process_group()              # STOP: leave together with rank 0
    except BaseException:  # noqa: BLE001 - reported to rank 0, which names this rank
        code = 1
        try:
            report.send(("error", traceback.format_exc()))
        except OSError:
            pass
    os._exit(code)


def _serve(runner, cmd) -> bool:
    """Run every step rank 0 sends. True at STOP; False when rank 0 is gone (end of file: leave at once)."""
    runner.sampler = _no_sampling
    while True:
        try:
            raw = cmd.recv_bytes()
        except EOFError:
            return False
        kind = int(np.frombuffer(raw, dtype=np.int64, count=1)[0])
        if kind == STOP:
            return True
        if kind == CALL:
            fn, args = pickle.loads(raw[8:])
            fn(runner, *args)
            continue
        if kind != STEP:
            raise ValueError(f"tensor parallel worker: unknown message kind {kind}")
        released, seqs = decode_step(np.frombuffer(raw, dtype=np.int64))
        for seq_id in released:
            runner.release(ShadowSequence(seq_id, 0, 0, 0, 0, [], [], finished=True))
        if seqs:
            runner.run(seqs)
