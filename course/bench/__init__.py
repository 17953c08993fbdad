"""The benchmarks: the engine on nano-vllm's workload (engine), Track K's kernels (kernels, k03, k04), the
HTTP server under load (serve).

Imports: itself, the runtime, the grader's selection layer (select, registry, state). Never the book.
"""
