"""The benchmarks: `./check.sh bench` parses and dispatches in cli; the workloads are the engine (engine, profile,
multiturn), Track K's kernels (kernels, k03, k04) and the HTTP server under load (serve); what several of them
share is in common (and roofline). A workload imports only common and roofline, never another workload.

Imports: itself, the runtime, the grader's selection layer (select, registry, state). Never the book.
"""
