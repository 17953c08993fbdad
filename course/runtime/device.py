"""`--device` and `--gpu-memory-gib` of `./check.sh run` and `./check.sh serve`: which engine serves, and its memory plan.

    --device cpu           e05's engine (the default; every machine has it)
    --device cuda          g01's engine on the GPU (the learner's k01-k05 and g01 once they pass, else the references),
                           with the memory plan of course/runtime/memory.py printed at start-up
    --gpu-memory-gib N     the plan budgets N GiB (a smaller card, emulated), as on `./check.sh bench` and `./check.sh gpu`

A model or setting that does not fit is refused before the weights (or the KV cache) are allocated: the plan's
paragraph in red and exit code 3, as `./check.sh bench` does.
"""

from __future__ import annotations

import os

REFUSED = 3          # the exit code of a start the memory plan refused (the bench's too)


def add_options(parser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: e05's engine (default); cuda: g01's GPU engine, with its memory plan printed")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, metavar="N",
                        help="with --device cuda: the memory plan budgets N GiB (a smaller card, emulated)")


def check_options(args, command: str) -> str | None:
    """The reason the options cannot run here (a Chinese message), or None; sets the cap for the engine's plan."""
    if args.gpu_memory_gib is not None:
        if args.device != "cuda":
            return f"./check.sh {command} --gpu-memory-gib N 只用于 GPU 引擎：请同时加 --device cuda"
        if not args.gpu_memory_gib > 0:
            return f"./check.sh {command} --gpu-memory-gib N：N 要是正数（GiB），得到 {args.gpu_memory_gib}"
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return (f"./check.sh {command} --device cuda 需要 NVIDIA GPU（CUDA）；这台机器没有。"
                    f"去掉 --device cuda 用 CPU 上的 e05 引擎")
        if args.gpu_memory_gib is not None:
            from .memory import ENV_CAP
            os.environ[ENV_CAP] = str(args.gpu_memory_gib)        # g01's plan reads it at start-up
    return None


def engine(args, select):
    """(LLM class, the keyword arguments it needs for args.device): g01's on CUDA, else e05's."""
    if args.device == "cuda":
        return select.load("g01_gpu_engine").LLM, {"device": "cuda"}
    return select.load("e05_engine").LLM, {}


def build(make, say):
    """make() -> the LLM; on CUDA its memory plan is said. None (after the red paragraph) when the plan refused it."""
    from .memory import MemoryPlanError
    try:
        llm = make()
    except MemoryPlanError as exc:                  # refused at start, with the numbers: no traceback
        from rich.markup import escape
        say(f"[red]{escape(str(exc))}[/]")
        return None
    plan = getattr(llm, "memory_plan", None)
    if plan is not None:
        say(plan.table(), markup=False)
    return llm
