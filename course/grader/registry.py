"""The exercise catalogue: one entry per exercise, in course order.

An exercise is *written* when its four files exist: the card, the stub, the reference and the checks.
Entries whose files are not there yet are listed by the CLI as coming (即将推出).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .select import ROOT

FORMAT_VERSION = 1

TRACKS = {
    "M": "模型实现",
    "E": "引擎",
    "K": "Triton 内核",
    "G": "GPU 总装",
}


@dataclass(frozen=True, slots=True)
class Exercise:
    id: str            # "m03"
    slug: str          # "sparse_moe"
    title: str         # card title line
    minutes: int
    difficulty: str    # 易 / 中 / 难
    needs_gpu: bool = False
    packages: tuple[str, ...] = ()     # importable modules its checks need beyond check.sh's READY set

    @property
    def missing_packages(self) -> list[str]:
        import importlib.util
        return [p for p in self.packages if importlib.util.find_spec(p) is None]

    @property
    def track(self) -> str:
        return self.id[0].upper()

    @property
    def number(self) -> int:
        """Position in the whole course (#3 for m03); names the hint A-N and walkthrough C-N."""
        return next(i for i, e in enumerate(CATALOGUE, 1) if e.id == self.id)

    @property
    def module(self) -> str:
        return f"{self.id}_{self.slug}"

    @property
    def book_section(self) -> str:
        return f"§{self.track}.{int(self.id[1:])}"

    @property
    def hint_ref(self) -> str:
        return f"A-{self.number}"

    @property
    def solution_ref(self) -> str:
        return f"C-{self.number}"

    @property
    def card(self) -> Path:
        return ROOT / "lessons" / f"{self.module}.md"

    @property
    def stub(self) -> Path:
        return ROOT / "mine" / f"{self.module}.py"

    @property
    def reference(self) -> Path:
        return ROOT / "solutions" / f"{self.module}.py"

    @property
    def checks(self) -> Path:
        return ROOT / "checks" / f"test_{self.module}.py"

    @property
    def plants(self) -> Path:
        return ROOT / "checks" / "plants" / f"{self.module}.py"

    @property
    def written(self) -> bool:
        return all(p.is_file() for p in (self.card, self.stub, self.reference, self.checks))


CATALOGUE: list[Exercise] = [
    Exercise("m01", "rmsnorm", "RMSNorm 家族：Qwen3 norm、fused residual、(1+w) norm 与 RMSNormGated", 40, "易"),
    Exercise("m02", "rope", "RoPE 家族：cos/sin cache、rotate-half、partial rotary 与交错 MRoPE", 50, "中"),
    Exercise("m03", "sparse_moe", "Sparse MoE：路由、按 expert 分组计算、shared expert", 60, "中"),
    Exercise("m04", "attention", "Attention：packed varlen 上的 QK-norm GQA 与 gated attention", 70, "中"),
    Exercise("m05", "gated_deltanet", "Gated DeltaNet：causal conv、delta rule 的递推与分块形式", 120, "难"),
    Exercise("m06", "models", "模型组装与 HF checkpoint 加载", 90, "中"),
    Exercise("m07", "tensor_parallel", "Tensor parallel 线性层、词表并行 embedding 与 LM head", 90, "中"),
    Exercise("e01", "sampling", "Sampling：SamplingParams 校验与按请求的批量采样", 45, "易"),
    Exercise("e02", "block_manager", "Paged KV cache：block manager、引用计数与 prefix caching", 75, "中"),
    Exercise("e03", "scheduler", "Scheduler：continuous batching、chunked prefill 与抢占", 75, "难"),
    Exercise("e04", "model_runner", "Model runner：batch 准备、paged attention 参考实现与 GDN 状态池", 90, "难"),
    Exercise("e05", "engine", "Engine loop：step、generate、streaming", 60, "中"),
    Exercise("e06", "serving", "Serving：OpenAI 兼容的流式 HTTP 服务、断开即 abort、准入控制", 90, "中",
             packages=("fastapi", "uvicorn", "httpx", "openai")),
    Exercise("k01", "triton_basics", "Triton：store_kvcache 与 fused add+RMSNorm kernel", 60, "中"),
    Exercise("k02", "paged_attention", "Triton：varlen prefill 与 split-K decode 的 paged attention", 120, "难"),
    Exercise("k03", "fused_moe", "Triton：fused MoE（对齐到 expert block 的 grouped GEMM）", 120, "难"),
    Exercise("k04", "gdn_kernels", "Triton：Gated DeltaNet 的递推 decode 与分块 prefill kernel", 150, "难"),
    Exercise("g01", "gpu_engine", "GPU 总装：decode 的 CUDA graphs、端到端校验与 benchmark", 120, "难", needs_gpu=True),
    Exercise("e07", "hybrid_prefix_cache", "混合模型的 prefix caching：Gated DeltaNet 状态快照", 90, "难"),
    Exercise("k05", "fp8", "Triton：block-scaled FP8 权重的 GEMM 与 fused MoE（weight-only 与 w8a8）", 120, "难"),
]

BY_ID = {e.id: e for e in CATALOGUE}


def get(exercise_id: str) -> Exercise:
    key = exercise_id.lower()
    if key not in BY_ID:
        known = ", ".join(BY_ID)
        raise KeyError(f"没有练习 {exercise_id!r}。可用的练习：{known}")
    return BY_ID[key]


def by_module(module: str) -> Exercise | None:
    return next((e for e in CATALOGUE if e.module == module), None)


def written() -> list[Exercise]:
    return [e for e in CATALOGUE if e.written]


def next_after(exercise_id: str | None, done: set[str]) -> Exercise | None:
    """The first written exercise after `exercise_id` (or from the start) that is not done."""
    start = 0 if exercise_id is None else CATALOGUE.index(BY_ID[exercise_id]) + 1
    order = CATALOGUE[start:] + CATALOGUE[:start]
    return next((e for e in order if e.written and e.id not in done and not e.needs_gpu), None)
