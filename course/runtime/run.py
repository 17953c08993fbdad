"""`./check.sh run`: assemble the engine from the learner's passed exercises (references for the rest) and generate.

    ./check.sh run --prompt "你好"                 a tiny dummy Qwen3 with a byte tokenizer (offline, random text)
    ./check.sh run --model DIR --prompt "你好"     a real HF folder: weights, tokenizer and chat template
"""

from __future__ import annotations

import argparse
import sys
import time

from ..grader import registry, select, state

ENGINE_MODULES = ["m01", "m02", "m03", "m04", "m05", "m06", "e01", "e02", "e03", "e04", "e05"]
GPU_MODULES = ["k01", "k02", "k03", "k04", "g01"]


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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """An unknown or malformed option: a Chinese message, exit 2 (argparse's own text kept for the detail)."""
        self.print_usage(sys.stderr)
        message = message.replace("unrecognized arguments:", "不认识的参数")
        self.exit(2, f"./check.sh run：参数错误（{message}）\n")


def main(argv: list[str], say) -> int:
    parser = _Parser(prog="./check.sh run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="你好，请用一句话介绍你自己。")
    parser.add_argument("--model", help="an HF model folder (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-chat", action="store_true", help="send the prompt as is, without the chat template")
    args = parser.parse_args(argv)

    selection, report = auto_selection()
    select.use(selection)
    say("[bold]引擎由这些文件组装[/]（已通过的练习用你的文件，其余用参考实现）：")
    for ex_id, path in report:
        say(f"  {ex_id}  {path}")

    import torch
    e01, e05 = select.load("e01_sampling"), select.load("e05_engine")
    start = time.perf_counter()
    if args.model:
        llm = e05.LLM(args.model, max_model_len=4096, num_kvcache_blocks=512)
        if llm.tokenizer is None:
            say("[red]--model 目录里没有 tokenizer，无法处理文本 prompt[/]")
            return 2
        tokenizer = llm.tokenizer
        say(f"模型：{args.model}（{llm.model.config.model_type}）")
    else:
        from .tiny_tokenizer import byte_tokenizer
        tokenizer = byte_tokenizer()
        torch.manual_seed(args.seed)
        llm = e05.LLM(tiny_dummy_config(len(tokenizer)), tokenizer=tokenizer, seed=args.seed)
        say("模型：离线的迷你 Qwen3（2 层，随机 dummy 权重，字节级 tokenizer）——输出是随机文本，只用来验证引擎能跑通。"
            "用 --model DIR 加载真实的 HF 模型目录。")
    prompt = args.prompt
    if not args.no_chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    params = e01.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    out = llm.generate([prompt], params)[0]
    seconds = time.perf_counter() - start
    if out.error:
        say(f"[red]请求被拒绝：{out.error}[/]")
        return 1
    say(f"\n[bold]prompt[/]（{len(out.prompt_token_ids)} tokens）：{args.prompt}")
    say(f"[bold]输出[/]（{len(out.token_ids)} tokens）：", end="")
    say(out.text, markup=False)
    say(f"\n[dim]{seconds:.1f} s（含加载）；统计：{llm.stats}[/]")
    return 0
