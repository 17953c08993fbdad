"""`./check.sh run`: assemble the engine from the learner's passed exercises (references for the rest) and generate.

    ./check.sh run --prompt "你好"                    a tiny dummy Qwen3 (dense) with a byte tokenizer (offline, random text)
    ./check.sh run --model tiny-hybrid               a tiny dummy Qwen3.5-MoE (Gated DeltaNet + gated attention, MoE):
                                                     a second chat turn resumes from the first one's GDN snapshot (e07)
    ./check.sh run --model DIR --prompt "你好"        a real HF folder: weights, tokenizer and chat template
    ./check.sh run --device cuda [--gpu-memory-gib N] g01's GPU engine, its memory plan printed (course/runtime/device.py)

Afterwards it says which of the engine's exercises the model ran (a function of the exercise's file was called:
ExerciseTrace) and, for every one it did not, what it needs and the command that runs it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..grader import registry, select, state
from . import device

ENGINE_MODULES = ["m01", "m02", "m03", "m04", "m05", "m06", "e01", "e02", "e03", "e04", "e05", "e07"]
GPU_MODULES = ["k01", "k02", "k03", "k04", "k05", "g01"]
HYBRID = "tiny-hybrid"            # the dummy model that runs every exercise of ENGINE_MODULES
# what an engine exercise that a model may leave out needs from the model (said when it did not run)
NEEDS = {"m03": "需要有 MoE 层的模型", "m05": "需要有 Gated DeltaNet 层的模型",
         "e07": "需要混合模型（有 Gated DeltaNet 层）：它的 prefix caching 靠状态快照"}
ELSEWHERE = ("./check.sh run 不组装的练习：e06 → ./check.sh serve；m07 → ./check.sh m07；"
             "k01–k05、g01 → ./check.sh gpu（需要 NVIDIA GPU）")
FOLLOW_UP = "请再说得详细一点。"    # the second turn's message on a hybrid model (e07)


def auto_selection(gpu: bool = False) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """mine/ for every passed exercise, solutions/ for the rest; and the (exercise, file) report."""
    passed = state.passed_ids(registry.CATALOGUE)
    selection, report = {"default": "solutions"}, []
    for ex_id in ENGINE_MODULES + (GPU_MODULES if gpu else []):
        ex = registry.get(ex_id)
        folder = "mine" if ex.id in passed else "solutions"
        selection[ex.module] = folder
        report.append((ex.id, f"{folder}/{ex.module}.py"))
    return selection, report


def kernel_source(exercise_id: str, force_solutions: bool) -> str:
    """The folder a Track K benchmark measures: mine/ once that exercise has passed, else (or with
    --solutions) the reference, the same rule the assembled engine uses."""
    if force_solutions:
        return "solutions"
    return "mine" if exercise_id in state.passed_ids(registry.CATALOGUE) else "solutions"


def tiny_dummy_config(vocab_size: int):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       tie_word_embeddings=True)


def tiny_hybrid_config(vocab_size: int = 512):
    """A tiny Qwen3.5-MoE text config: 3 Gated DeltaNet layers and 1 gated full attention layer, every layer MoE with
    a shared expert. `./check.sh run --model tiny-hybrid` and the CPU run of `bench --workload multiturn` use it."""
    from transformers import AutoConfig
    return AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])


# --model NAME: offline models with random weights and the byte tokenizer, (what it is, its config for a vocabulary)
DUMMY_MODELS = {
    "tiny": ("离线的迷你 Qwen3（稠密：2 层 attention + MLP）", tiny_dummy_config),
    HYBRID: ("离线的迷你 Qwen3.5-MoE（混合：3 层 Gated DeltaNet + 1 层 gated attention，每层 MoE）", tiny_hybrid_config),
}


class ExerciseTrace:
    """`with ExerciseTrace({"m01": path, ...}) as ran:` - the exercises whose file had a function called in the block.

    sys.settrace's global hook is called once per Python function call; it answers None (no line events), so the
    cost is one dict lookup per call (a few per cent of a run of the tiny models)."""

    def __init__(self, files: dict[str, Path]):
        self.by_file = {str(path): ex_id for ex_id, path in files.items()}
        self.ran: set[str] = set()

    def _call(self, frame, event, arg):
        ex_id = self.by_file.get(frame.f_code.co_filename)
        if ex_id is not None:
            self.ran.add(ex_id)

    def __enter__(self) -> set[str]:
        self.before = sys.gettrace()
        sys.settrace(self._call)
        return self.ran

    def __exit__(self, *exc) -> None:
        sys.settrace(self.before)


def usage_report(report: list[tuple[str, str]], ran: set[str], model: str) -> list[str]:
    """What the run says after generating: the exercises the model ran, each one it did not (with what it needs and
    the command that runs it), and the exercises ./check.sh run never assembles."""
    used = [ex_id for ex_id, _ in report if ex_id in ran]
    unused = [(ex_id, path) for ex_id, path in report if ex_id not in ran]
    share = f"的全部 {len(used)} 个练习" if not unused else f" {len(report)} 个练习中的 {len(used)} 个"
    lines = [f"这个模型用到了引擎{share}（生成时调用了它们文件里的函数）：{' '.join(used)}"]
    if unused:
        lines.append("[yellow]这个模型没有用到、这次没有验证的练习：[/]")
        width = max(len(path) for _, path in unused)
        lines += [f"  {ex_id}  {path:<{width}}  {NEEDS.get(ex_id, '这个模型的路径上没有它')}" for ex_id, path in unused]
        if model != HYBRID:
            lines.append(f"  运行它们：./check.sh run --model {HYBRID}")
    lines.append(f"[dim]{ELSEWHERE}[/]")
    return lines


def next_turn(tokenizer, first, follow_up: str, chat: bool) -> list[int]:
    """The second turn of a chat as token ids: the first turn's prompt and answer exactly as the engine computed them
    (so that its cached prefix matches), then the end of the answer and a new user message."""
    answer = list(first.token_ids)
    if answer and answer[-1] == tokenizer.eos_token_id:
        answer.pop()                                  # the template closes the answer itself
    if chat:
        mark = "\ue000"                               # a private-use character: where the answer goes in the chat
        text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": mark},
                                              {"role": "user", "content": follow_up}], tokenize=False,
                                             add_generation_prompt=True)
        tail = text[text.index(mark) + len(mark):]
    else:
        tail = "\n" + follow_up
    return list(first.prompt_token_ids) + answer + list(tokenizer.encode(tail, add_special_tokens=False))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """An unknown or malformed option: a Chinese message, exit 2 (argparse's own text kept for the detail)."""
        self.print_usage(sys.stderr)
        message = message.replace("unrecognized arguments:", "不认识的参数")
        self.exit(2, f"./check.sh run：参数错误（{message}）\n")


def main(argv: list[str], say) -> int:
    parser = _Parser(prog="./check.sh run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="你好，请用一句话介绍你自己。")
    parser.add_argument("--model", default="tiny", metavar="tiny|tiny-hybrid|DIR",
                        help="a dummy model (tiny: dense Qwen3, the default; tiny-hybrid: Qwen3.5-MoE with Gated DeltaNet "
                             "layers) or an HF model folder (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    device.add_options(parser)
    args = parser.parse_args(argv)
    dummy = args.model in DUMMY_MODELS
    if not dummy and not Path(args.model).is_dir():
        say(f"[red]没有这个模型目录：{args.model}。离线的 dummy 模型：{'、'.join(DUMMY_MODELS)}[/]")
        return 2
    problem = device.check_options(args, "run")
    if problem:
        say(problem, style="red", markup=False)
        return 2

    selection, report = auto_selection(gpu=args.device == "cuda")
    select.use(selection)
    say("[bold]引擎由这些文件组装[/]（已通过的练习用你的文件，其余用参考实现；这个模型用到了哪些，生成之后再说）：")
    for ex_id, path in report:
        say(f"  {ex_id}  {path}")

    import torch
    e01 = select.load("e01_sampling")
    LLM, on_device = device.engine(args, select)
    start = time.perf_counter()
    # what imports transformers runs outside the trace: a traced import is several times slower
    if dummy:
        from .tiny_tokenizer import byte_tokenizer
        tokenizer = byte_tokenizer()
        what, make_config = DUMMY_MODELS[args.model]
        config = make_config(len(tokenizer))
    else:
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (imported for e05's loader)
    files = {ex_id: select.resolve(registry.get(ex_id).module) for ex_id, _ in report}
    with ExerciseTrace(files) as ran:
        if dummy:
            torch.manual_seed(args.seed)
            llm = device.build(lambda: LLM(config, tokenizer=tokenizer, seed=args.seed, enable_prefix_caching=True,
                                           **on_device), say)
            if llm is None:
                return device.REFUSED
            say(f"模型：{what}，随机 dummy 权重，字节级 tokenizer——输出是随机文本，只用来验证引擎能跑通。"
                "用 --model DIR 加载真实的 HF 模型目录。")
        else:
            # on the GPU the memory plan sizes the KV cache from the card (or --gpu-memory-gib)
            blocks = {} if args.device == "cuda" else {"num_kvcache_blocks": 512}
            llm = device.build(lambda: LLM(args.model, max_model_len=4096, enable_prefix_caching=True, **blocks,
                                           **on_device), say)
            if llm is None:
                return device.REFUSED
            if llm.tokenizer is None:
                say("[red]--model 目录里没有 tokenizer，无法处理文本 prompt[/]")
                return 2
            tokenizer = llm.tokenizer
            say(f"模型：{args.model}（{llm.model.config.model_type}）")
        prompt = args.prompt
        chat = not args.no_chat and bool(getattr(tokenizer, "chat_template", None))
        if chat:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
        params = e01.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        out = llm.generate([prompt], params)[0]
        if out.error:
            say(f"[red]请求被拒绝：{out.error}[/]")
            return 1
        say(f"\n[bold]prompt[/]（{len(out.prompt_token_ids)} tokens）：{args.prompt}")
        say(f"[bold]输出[/]（{len(out.token_ids)} tokens）：", end="")
        say(out.text, markup=False)
        if "snapshot_hits" in llm.stats:             # e07's snapshots: only a later turn sharing the prefix hits them
            # another seed: on random weights the logits are nearly flat, so the same draws would repeat the answer
            params = e01.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + 1)
            second_turn(llm, tokenizer, out, params, chat, say)
    seconds = time.perf_counter() - start
    say(f"\n[dim]{seconds:.1f} s（含加载）；统计：{llm.stats}[/]\n")
    for line in usage_report(report, ran, args.model):
        say(line)
    return 0


def second_turn(llm, tokenizer, first, params, chat: bool, say) -> None:
    """The chat's next turn (the first prompt + its answer + FOLLOW_UP): on a hybrid model with prefix caching it
    resumes from the snapshot of the GDN states that the first turn's decode left at its last block boundary (e07)."""
    ids = next_turn(tokenizer, first, FOLLOW_UP, chat)
    before = llm.stats
    out = llm.generate([ids], params)[0]
    if out.error:
        say(f"[yellow]第二轮被拒绝：{out.error}[/]")
        return
    hits = llm.stats["snapshot_hits"] - before["snapshot_hits"]
    saved = llm.stats["prefill_tokens_saved"] - before["prefill_tokens_saved"]
    say(f"\n[bold]第二轮[/]（第一轮的 prompt + 回答 + “{FOLLOW_UP}”，{len(ids)} tokens）：", end="")
    if hits:
        say(f"前 {saved} 个 token 从 prefix cache 接着算（KV block + 第一轮留下的 Gated DeltaNet 状态快照，e07），"
            f"只算了 {len(ids) - saved} 个")
    else:
        say("[yellow]没有命中状态快照，整个 prompt 从头算（e07 的快照没有用上）[/]")
    say(f"[bold]输出[/]（{len(out.token_ids)} tokens）：", end="")
    say(out.text, markup=False)
