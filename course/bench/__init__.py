"""The benchmarks: `./check.sh bench` parses and dispatches in cli; the workloads are the engine (engine, profile,
multiturn), Track K's kernels (kernels, k03, k04) and the HTTP server under load (serve); what several of them
share is in common (and roofline: the decode bound), including the one timing helper of every kernel bench
(common.time_cycled); repeat_check (`python -m course.bench.repeat_check`) compares the --json files of several runs
of the kernel benches. A workload imports only common and roofline, never another workload.

Imports: itself, the runtime, the grader's selection layer (select, registry, state). Never the book.
"""
