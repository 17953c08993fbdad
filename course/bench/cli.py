"""`./check.sh bench ...`: every benchmark's command line in one place: the parsers, `--help`, the dispatch.

    ./check.sh bench [options]                   the engine's throughput on nano-vllm's workload (engine.py, GPU)
    ./check.sh bench --profile [options]         one prefill, decode, graph replay and mixed step under torch.profiler
    ./check.sh bench --tp N [options]            the same workload at TP=N and TP=1 (engine.bench_tp)
    ./check.sh bench --workload multiturn ...    multi-turn chats, hybrid prefix caching off and on (multiturn.py, e07)
    ./check.sh bench --serve ...                 throughput and TTFT through HTTP (serve.py, e06)
    ./check.sh bench k01|k02|k03|k04|k05 ...     Track K's kernels (kernels.py, k03.py, k04.py, k05.py)
    ./check.sh bench --help                      every workload, subcommand and option, one line each

This module imports the workloads (inside the functions that run them, so that --help stays fast); the
workloads import only the shared helpers (common.py, roofline.py), never each other nor this module: the
package has no import cycle (tests/test_layout.py checks it).
"""

from __future__ import annotations

import argparse
import sys

from rich.cells import cell_len

from .common import MODELS, REPLAYS, SPREAD_LIMIT

KERNELS = ("k01", "k02", "k03", "k04", "k05")
# the defaults of the throughput workload that differ on the CPU smoke run (--device cpu): (GPU, CPU, what)
ENGINE_DEFAULTS = {
    "num_seqs": (256, 4, "请求数"),
    "max_input_len": (1024, 128, "prompt 最长的 token 数"),
    "max_output_len": (1024, 128, "输出最长的 token 数"),
}
# the defaults of the multiturn workload: (GPU, CPU smoke test); None for both when the device picks them
MULTITURN_DEFAULTS = {
    "conversations": (64, 4, "会话数"),
    "turns": (4, 3, "每个会话的轮数"),
    "system_len": (1000, 96, "共享 system prompt 长度"),
    "message_len": (100, 16, "每轮新消息的 token 数"),
    "answer_len": (64, 24, "回答 N/2–3N/2 个 token"),
    "block_size": (16, 16, "KV cache 每块的 token 数"),
    "max_num_batched_tokens": (8192, 256, "一步最多算多少个 token"),
    "snapshots": (256, 16, "GDN 状态快照最多几份"),
}


class _Parser(argparse.ArgumentParser):
    """A bench parser: no argparse -h (./check.sh bench --help prints every parser at once); errors in Chinese, exit 2."""

    def __init__(self, prog: str):
        super().__init__(prog=prog, add_help=False)

    def error(self, message: str):
        self.print_usage(sys.stderr)
        message = message.replace("unrecognized arguments:", "不认识的参数")
        self.exit(2, f"{self.prog}：参数错误（{message}）。所有负载和选项：./check.sh bench --help\n")


def parsers() -> dict[str, _Parser]:
    """Every parser of `./check.sh bench`: the throughput run (with --profile and --tp), multiturn, serve, k01-k04."""
    engine = _Parser("./check.sh bench")
    engine.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b", metavar="NAME",
                        help="默认 qwen3-0.6b；qwen3-30b-a3b、qwen3.5-35b-a3b")
    engine.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="默认 cuda；cpu：迷你 Qwen3 上的冒烟测试")
    for name, (gpu, cpu, text) in ENGINE_DEFAULTS.items():
        engine.add_argument("--" + name.replace("_", "-"), type=int, default=None, metavar="N",
                            help=f"{text}（默认 GPU {gpu}、CPU {cpu}）")
    engine.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="计时跑 N 遍（每遍换 token）：中位数、最小–最大")
    engine.add_argument("--dtype", choices=["bf16", "fp8", "w8a8"], default="bf16",
                        help="权重 bf16（默认）、fp8（k05 块量化）或 w8a8")
    engine.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="引擎同时运行的序列上限（默认 256）")
    engine.add_argument("--max-model-len", type=int, default=4096, metavar="N", help="一条序列最长的 token 数（默认 4096）")
    engine.add_argument("--block-size", type=int, default=32, metavar="N", help="KV cache 每块的 token 数（默认 32）")
    engine.add_argument("--enforce-eager", action="store_true", help="不用 CUDA graphs（对照用）")
    engine.add_argument("--gpu-memory-gib", type=float, default=None, metavar="N",
                        help="显存预算 N GiB（模拟更小的卡）")
    engine.add_argument("--no-async-scheduling", action="store_true",
                        help="每步等 token 回到 host 再调度下一步（对照用）")
    engine.add_argument("--peer", choices=["hf", "none"], default="none",
                        help="hf：再跑 HF transformers 并打印倍数（默认 none）")
    engine.add_argument("--peer-num-seqs", type=int, default=None, metavar="N",
                        help="--peer hf 时两边共用的较小负载")
    engine.add_argument("--profile", action="store_true",
                        help="改跑 torch.profiler 拆开几个典型的步（见上）")
    engine.add_argument("--tp", type=int, default=1, metavar="N",
                        help="张量并行：先 TP=N 再 TP=1，打印加速比（默认 1）")
    engine.add_argument("--plot", default=None, metavar="PNG",
                        help="吞吐随时间（平滑）、roofline、batch 的图")
    engine.add_argument("--json", default=None, metavar="FILE",
                        help="每遍的结果、命令行、机器、版本另存为 JSON")
    # a parent process starts its children with these: one engine per process
    engine.add_argument("--tp-run", type=int, default=0, metavar="N", help=argparse.SUPPRESS)
    engine.add_argument("--engine-run", choices=["course", "hf"], default=None, help=argparse.SUPPRESS)
    engine.add_argument("--subset", type=int, default=0, metavar="N", help=argparse.SUPPRESS)

    multiturn = _Parser("./check.sh bench")
    multiturn.add_argument("--workload", choices=["multiturn"], required=True, help="选这个负载")
    multiturn.add_argument("--model", default="qwen3.5-35b-a3b", choices=["qwen3.5-35b-a3b"],
                           help="GPU 上的模型（CPU 上是迷你的 Qwen3.5-MoE）")
    multiturn.add_argument("--device", choices=["cuda", "cpu"], default=None,
                           help="默认：有 GPU 就 cuda；cpu 是冒烟测试")
    for name, (gpu, cpu, text) in MULTITURN_DEFAULTS.items():
        multiturn.add_argument("--" + name.replace("_", "-"), type=int, default=None, metavar="N",
                               help=f"{text}（默认 GPU {gpu}、CPU {cpu}）")
    multiturn.add_argument("--max-model-len", type=int, default=None, metavar="N",
                           help="一条序列最长的 token 数（默认：最长的会话 + 64）")
    multiturn.add_argument("--num-kvcache-blocks", type=int, default=2048, metavar="N",
                           help="KV cache 的块数，只用于 CPU（默认 2048）")
    multiturn.add_argument("--enforce-eager", action="store_true", help="不用 CUDA graphs（GPU）")
    multiturn.add_argument("--fixed-answers", action="store_true",
                           help="回答都正好 --answer-len 个 token（会话齐步走）")
    multiturn.add_argument("--repeats", type=int, default=1, metavar="N",
                           help="每个引擎计时跑 N 遍，取中位数（默认 1）")
    multiturn.add_argument("--json", default=None, metavar="FILE", help="结果另存为 JSON")

    serve = _Parser("./check.sh bench")
    serve.add_argument("--serve", action="store_true", required=True, help="选这个负载")
    serve.add_argument("--model", metavar="DIR", help="HF 模型目录（默认：迷你 dummy 模型，CPU）")
    serve.add_argument("--requests", type=int, default=64, metavar="N", help="每次运行的请求数（默认 64）")
    serve.add_argument("--clients", type=int, default=32, metavar="N", help="同时发请求的 HTTP 客户端数（默认 32）")
    serve.add_argument("--min-in", type=int, default=16, metavar="N", help="prompt 最短的 token 数（默认 16）")
    serve.add_argument("--max-in", type=int, default=64, metavar="N", help="prompt 最长的 token 数（默认 64）")
    serve.add_argument("--min-out", type=int, default=16, metavar="N", help="输出最短的 token 数（默认 16）")
    serve.add_argument("--max-out", type=int, default=64, metavar="N", help="输出最长的 token 数（默认 64）")
    serve.add_argument("--max-pending", type=int, metavar="N", help="在途请求上限，超过得 503（默认不限）")
    serve.add_argument("--max-num-seqs", type=int, default=32, metavar="N", help="引擎同时运行的序列上限（默认 32）")
    serve.add_argument("--num-kvcache-blocks", type=int, default=512, metavar="N", help="KV cache 的块数（默认 512）")

    found = {"engine": engine, "multiturn": multiturn, "serve": serve}
    for kernel in KERNELS:
        p = found[kernel] = _Parser(f"./check.sh bench {kernel}")
        if kernel == "k03":
            p.add_argument("--shapes", default="0,1", metavar="LIST",
                           help="0：Qwen3-30B-A3B，1：Qwen3.5-35B-A3B（默认 0,1）")
            p.add_argument("--no-loop", action="store_true", help="prefill 不测 m03 的逐 expert 循环（很慢）")
        p.add_argument("--solutions", action="store_true", help="测参考实现，即使你的文件已通过")
        p.add_argument("--replays", type=int, default=REPLAYS, metavar="N",
                       help=f"每行重放 N 次（默认 {REPLAYS}）；波动 > {SPREAD_LIMIT:.0%} 不下结论")
        p.add_argument("--json", default=None, metavar="FILE",
                       help="每行的中位数、最小–最大、结论另存为 JSON")
    return found


# (what follows `./check.sh bench`, what it measures): the first lines of `--help`
COMMANDS = [
    ("[选项]", "引擎吞吐：nano-vllm 的 256 条随机请求（GPU）"),
    ("--profile [选项]", "profiler 拆开 prefill、decode、混合步（GPU）"),
    ("--tp N [选项]", "先 TP=N 再 TP=1：加速比（N 块 GPU）"),
    ("--workload multiturn [选项]", "多轮对话，关 / 开 prefix caching（e07）"),
    ("--serve [选项]", "HTTP 服务（e06）的吞吐与 TTFT"),
    ("k01 [选项]", "store_kvcache、add + RMSNorm 的带宽（GPU）"),
    ("k02 [选项]", "paged attention，对照 torch SDPA（GPU）"),
    ("k03 [选项]", "fused MoE，对照 m03 与 grouped GEMM（GPU）"),
    ("k04 [选项]", "Gated DeltaNet kernel，对照 fla、HF（GPU）"),
    ("k05 [选项]", "FP8 线性层与 MoE，对照 bf16 与 _scaled_mm（GPU）"),
]
SECTIONS = [    # (parser keys, heading): options shared by several commands are listed once
    (("engine",), "引擎吞吐、--profile、--tp 的选项"),
    (("multiturn",), "--workload multiturn 的选项"),
    (("serve",), "--serve 的选项"),
    (("k01", "k02", "k04", "k05"), "k01、k02、k04、k05 的选项"),
    (("k03",), "k03 的选项"),
]


def _option(action: argparse.Action) -> str:
    """`--name VALUE` as the help shows it."""
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    if action.metavar:
        return f"{names} {action.metavar}"
    return f"{names} {{{','.join(action.choices)}}}" if action.choices else f"{names} VALUE"


def _pad(text: str, width: int) -> str:
    """text left-aligned in `width` terminal cells (a CJK character takes two)."""
    return text + " " * max(0, width - cell_len(text))


def help_text() -> str:
    """Every workload, subcommand and option of `./check.sh bench`, one line each, from the parsers themselves."""
    ps = parsers()
    width = 27
    lines = ["用法：./check.sh bench [负载或子命令] [选项]", "", "负载与子命令（写在 ./check.sh bench 后面）："]
    lines += [f"  {_pad(cmd, width)}  {what}" for cmd, what in COMMANDS]
    hidden = []
    for keys, heading in SECTIONS:
        lines += ["", heading + "："]
        for action in ps[keys[0]]._actions:
            if action.help == argparse.SUPPRESS:
                hidden.append(_option(action))
                continue
            left = _option(action)
            lines.append(f"  {_pad(left, width)}  {action.help}")
    lines += ["", f"  {_pad('-h, --help', width)}  这一页（任何负载、子命令后加 --help 也是它）",
              f"  内部用（父进程传给子进程）：{'、'.join(hidden)}"]
    return "\n".join(lines)


def main(argv: list[str], say) -> int:
    """Parse `./check.sh bench ...` with the parser of the workload it names, then run that workload."""
    if "-h" in argv or "--help" in argv:
        say(help_text(), markup=False)
        return 0
    ps = parsers()
    if argv and argv[0] in KERNELS:
        opts = ps[argv[0]].parse_args(argv[1:])
        if opts.replays < 3:
            ps[argv[0]].error(f"--replays 至少是 3，得到 {opts.replays}")
        opts.argv = list(argv)                         # the command line, for --json
        if argv[0] == "k03":
            from .k03 import bench_k03
            return bench_k03(opts, say)
        if argv[0] == "k04":
            from .k04 import bench_k04
            return bench_k04(opts)
        if argv[0] == "k05":
            from .k05 import bench_k05
            return bench_k05(opts)
        from .kernels import bench_kernel
        return bench_kernel(argv[0], opts)
    if "--serve" in argv:
        opts = ps["serve"].parse_args(argv)
        if not (1 <= opts.min_in <= opts.max_in and 1 <= opts.min_out <= opts.max_out and opts.clients >= 1):
            ps["serve"].error("需要 1 ≤ --min-in ≤ --max-in、1 ≤ --min-out ≤ --max-out、--clients ≥ 1")
        from .serve import run
        return run(opts, say)
    if any(a == "--workload" or a.startswith("--workload=") for a in argv):
        opts = ps["multiturn"].parse_args(argv)
        if opts.repeats < 1:
            ps["multiturn"].error(f"--repeats 至少是 1，得到 {opts.repeats}")
        opts.argv = list(argv)                         # the command line, for --json
        from .multiturn import run
        return run(opts, say)
    opts = ps["engine"].parse_args(argv)
    if opts.repeats < 1:
        ps["engine"].error(f"--repeats 至少是 1，得到 {opts.repeats}")
    cpu = opts.device == "cpu"
    if cpu and (opts.peer != "none" or opts.tp > 1 or opts.tp_run or opts.profile or opts.engine_run):
        ps["engine"].error("--device cpu 只跑引擎吞吐的冒烟测试，不能和 --peer hf、--tp、--profile 同用")
    if opts.dtype != "bf16" and (cpu or opts.tp > 1 or opts.tp_run or opts.peer != "none"):
        ps["engine"].error(f"--dtype {opts.dtype} 跑 k05 的 FP8 kernel：只在 GPU 上、TP=1，不能和 --device cpu、--tp、"
                           "--peer hf 同用")
    for name, (gpu_default, cpu_default, _) in ENGINE_DEFAULTS.items():
        if getattr(opts, name) is None:
            setattr(opts, name, cpu_default if cpu else gpu_default)
    if min(opts.max_input_len, opts.max_output_len) < 100:
        ps["engine"].error("nano-vllm 的负载取 randint(100, N)：--max-input-len、--max-output-len 至少是 100")
    if opts.gpu_memory_gib is not None:
        if cpu or not opts.gpu_memory_gib > 0:
            ps["engine"].error("--gpu-memory-gib N 要 N > 0，且只用于 GPU（不能和 --device cpu 同用）")
        import os
        from ..runtime.memory import ENV_CAP
        os.environ[ENV_CAP] = str(opts.gpu_memory_gib)      # the engine's plan reads it; child processes inherit it
    import torch
    if not cpu and not torch.cuda.is_available():
        say("[yellow]./check.sh bench 需要 NVIDIA GPU（CUDA）；这台机器没有，未运行。"
            "CPU 上能跑的：./check.sh bench --device cpu（迷你模型上的冒烟测试）、./check.sh bench --serve、"
            "./check.sh bench --workload multiturn --device cpu[/]")
        return 2
    if opts.profile:
        opts.argv = list(argv)                         # the command line, for --json
        from .profile import profile_steps
        return profile_steps(opts, say)
    from .engine import bench
    return bench(opts, argv, say)
