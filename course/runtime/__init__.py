"""The engine's runtime that learners use but do not write: `./check.sh run` (run), the HTTP server entry
(serve), the tensor-parallel process layout (tp_engine), the offline tokenizer of the dummy model.

Imports: itself, the selection layer of the grader (select, registry, state) and the exercise files it selects.
Never the benchmarks or the book.
"""
