"""What every check file uses: loading the graded module, seeds, tolerances, comparisons that explain.

Conventions
- Decorate each check with `@point("…")`: the 验收要点 it grades, exactly as the card words it.
- Load the exercise inside the check (`mod = impl("m03_sparse_moe")`), never at import time, so a
  stub with a syntax error fails each check on its own instead of the whole file.
- Shapes and seeds are random on every run (a hard-coded answer fails); the seed is printed in every
  failure message and `COURSE_SEED=<n>` replays it.
- Compare with `assert_close`, giving `looks_like=[(wrong_tensor, "易错点 …"), ...]`: when the
  learner's output matches one of the classic wrong answers, the message names that mistake.
"""

from __future__ import annotations

import contextlib
import os
import random
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from course.grader import select

# one tolerance table per dtype (used unless a check says otherwise)
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def point(title: str):
    return pytest.mark.point(title)


# a check that only means something on a GPU (native Triton at realistic shapes): reported as skipped, never passed
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="需要 GPU")


def needs_cuda_devices(count: int):
    """A check that needs `count` CUDA devices (tensor parallel over NCCL): skipped with fewer, never passed."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < count, reason=f"需要 {count} 块 GPU（这台机器有 {have} 块）")

# Track K: where a check runs the learner's Triton kernels. With CUDA natively on the GPU; without it on the CPU
# through the Triton interpreter (checks/conftest.py). Inputs are drawn on the CPU (Rand's generator, so a seed
# replays the same numbers on both machines) and moved with `to_dev`; the torch oracles run on the CPU, and
# kernel outputs come back with `to_cpu` (assert_close / assert_equal bring them back themselves).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 oracles are exact fp32 on CUDA too: cuDNN runs convolutions (HF's GDN conv1d) in TF32 unless told not to,
# which moves a slowly decaying GDN head's output by ~1e-3 after a few thousand tokens
torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False


def to_dev(*tensors):
    """The tensors on DEVICE (None and non-tensors unchanged; a no-op without CUDA); one argument -> one result."""
    moved = tuple(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def to_cpu(*tensors):
    """The tensors on the CPU (None and non-tensors unchanged; a no-op without CUDA); one argument -> one result."""
    moved = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def impl(module: str) -> types.ModuleType:
    return select.load(module)


# Contract coverage (checks/contracts/<id>.toml, tests/test_contracts.py): a check calls record_case("label") when it
# draws a named case of the card's contract; with COURSE_CASES set, one line "<check function>\t<label>" is appended
# to that file (nothing otherwise, so learners never see it). The contract table maps each clause to (check, case).
CASES_ENV = "COURSE_CASES"


def record_case(label: str) -> None:
    path = os.environ.get(CASES_ENV)
    if not path:
        return
    current = os.environ.get("PYTEST_CURRENT_TEST", "")              # "checks/test_x.py::test_name (call)"
    check = current.split("::")[-1].split(" ")[0].split("[")[0]
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{check}\t{label}\n")


def new_seed() -> int:
    env = os.environ.get("COURSE_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


class Rand:
    """A seeded source of random shapes and tensors; `str(r)` is used in failure messages."""

    def __init__(self, seed: int | None = None):
        self.seed = new_seed() if seed is None else seed
        self.py = random.Random(self.seed)
        self.gen = torch.Generator().manual_seed(self.seed)

    def int(self, lo: int, hi: int) -> int:
        return self.py.randint(lo, hi)

    def choice(self, options):
        return self.py.choice(list(options))

    def randn(self, *shape, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * scale).to(dtype)

    def randint(self, lo: int, hi: int, shape) -> torch.Tensor:
        return torch.randint(lo, hi, tuple(shape), generator=self.gen)

    def init_(self, module: torch.nn.Module, std: float = 0.2, mean: float = 0.0) -> torch.nn.Module:
        """Randomise every parameter (HF leaves MoE experts as torch.empty and norms at 1 or 0)."""
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=self.gen) * std + mean)
        return module

    def __str__(self) -> str:
        return f"seed={self.seed}（COURSE_SEED={self.seed} 可复现）"


def _max_err(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, tuple]:
    diff = (actual.double() - expected.double()).abs()
    diff = torch.nan_to_num(diff, nan=float("inf"))
    flat = int(diff.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    return float(diff.max()) if diff.numel() else 0.0, idx


def close(actual, expected, atol: float, rtol: float) -> bool:
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
        return False
    return torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol)


def assert_close(actual, expected: torch.Tensor, *, what: str, rand: Rand | None = None,
                 atol: float | None = None, rtol: float | None = None, looks_like=()) -> None:
    """Shape, then values; on a mismatch name the worst element and any classic mistake it matches."""
    tol = TOL.get(expected.dtype, TOL[torch.float32])
    atol = tol["atol"] if atol is None else atol
    rtol = tol["rtol"] if rtol is None else rtol
    seed = f"；{rand}" if rand is not None else ""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}：应返回 torch.Tensor，得到 {type(actual).__name__}{seed}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}：形状应为 {list(expected.shape)}，得到 {list(actual.shape)}{seed}")
    actual, expected = to_cpu(actual, expected)                      # a kernel's output may live on the GPU
    if close(actual, expected, atol, rtol):
        return
    err, idx = _max_err(actual, expected)
    msg = (f"{what}：与参考不一致，最大误差 {err:.3g}，位置 {list(idx)}"
           f"（得到 {float(actual[idx]):.6g}，期望 {float(expected[idx]):.6g}；atol={atol:g}, rtol={rtol:g}）{seed}")
    for wrong, mistake in looks_like:
        if wrong is not None and close(actual, to_cpu(wrong), max(atol, 1e-5), max(rtol, 1e-5)):
            msg += f"\n  看起来像易错点：{mistake}"
            break
    raise AssertionError(msg)


def assert_equal(actual, expected: torch.Tensor, *, what: str, rand: Rand | None = None, looks_like=()) -> None:
    """Exact equality (integer ids, bit-exact casts)."""
    seed = f"；{rand}" if rand is not None else ""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}：应返回 torch.Tensor，得到 {type(actual).__name__}{seed}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}：形状应为 {list(expected.shape)}，得到 {list(actual.shape)}{seed}")
    actual, expected = to_cpu(actual, expected)
    if torch.equal(actual.to(expected.dtype), expected):
        return
    bad = (actual.to(expected.dtype) != expected).nonzero()
    first = tuple(int(i) for i in bad[0])
    msg = (f"{what}：有 {len(bad)} 个元素不同，第一个在 {list(first)}"
           f"（得到 {actual[first].item()}，期望 {expected[first].item()}）{seed}")
    for wrong, mistake in looks_like:
        if wrong is not None and wrong.shape == actual.shape and torch.equal(actual.to(wrong.dtype), to_cpu(wrong)):
            msg += f"\n  看起来像易错点：{mistake}"
            break
    raise AssertionError(msg)


def assert_dtype(actual: torch.Tensor, dtype: torch.dtype, *, what: str, mistake: str = "") -> None:
    if actual.dtype != dtype:
        hint = f"\n  看起来像易错点：{mistake}" if mistake else ""
        raise AssertionError(f"{what}：dtype 应为 {dtype}，得到 {actual.dtype}{hint}")


def crash_text(exc: BaseException) -> str:
    """'Type: message' of a crash; for the Triton interpreter's InterpreterError (raised at the kernel launch) the
    error inside the @triton.jit function that it wraps (its __cause__), marked as such."""
    if type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None:
        inner = exc.__cause__
        return f"{type(inner).__name__}: {inner}（Triton 解释器：出错的是 @triton.jit 函数里的这一行，见“位置”）"
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def explain_crash(patterns: dict[str, str]):
    """Turn a crash whose text contains a known fragment into a failure naming the mistake (chained `from` the
    crash, so the grader's 位置 is still the line in the exercise file; for a Triton kernel run by the
    interpreter, the line inside the @triton.jit function). The exceptions it was raised while handling are
    searched first (a CUDA graph capture that failed inside reports "a previous error during capture" on exit).

    with explain_crash({"cannot be multiplied": "gate/up 投影少了转置"}): ...
    """
    try:
        yield
    except Exception as exc:
        crash = (RuntimeError, IndexError, AttributeError, TypeError, ValueError)
        if not isinstance(exc, crash) and type(exc).__name__ != "InterpreterError":
            raise
        text = crash_text(exc)
        chain, inner = [], exc              # the crash and what it was raised while handling, the root cause first
        while inner is not None and len(chain) < 6:
            chain.insert(0, crash_text(inner))
            inner = inner.__context__
        for cause in chain:
            for fragment, mistake in patterns.items():
                if fragment in cause:
                    first = f"（最先出错的是：{cause}）" if cause != text else ""
                    raise AssertionError(f"运行出错：{text}{first}\n  看起来像易错点：{mistake}") from exc
        raise


class OpCount(TorchDispatchMode):
    """Counts every torch operator that runs inside it (a loop over tokens shows up as a count that grows)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class GuardedAlloc(TorchFunctionMode):
    """Inside it, every contiguous float tensor from torch.empty / empty_like / zeros / ... is the front of a
    longer buffer whose tail holds NaN: a kernel that stores past the end of its output shows up there."""

    FACTORIES = {torch.empty, torch.empty_like, torch.zeros, torch.zeros_like, torch.Tensor.new_empty,
                 torch.Tensor.new_zeros, torch.empty_strided}

    def __init__(self):
        super().__init__()
        self.tails: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in self.FACTORIES or not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point \
                or not out.is_contiguous():
            return out
        n = out.numel()                                   # (the mode is off inside its own handler)
        buf = torch.full((2 * n + 4096,), float("nan"), dtype=out.dtype, device=out.device)
        if func in (torch.zeros, torch.zeros_like, torch.Tensor.new_zeros):
            buf[:n] = 0
        self.tails.append(buf[n:])
        return buf[:n].view(out.shape)

    def overran(self) -> bool:
        return any(not bool(torch.isnan(t).all()) for t in self.tails)
