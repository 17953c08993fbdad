"""The grader: which exercises exist (registry), which folder backs each (select), progress (state), running
an exercise's checks (grade), reading cards (cards), making stubs (stubgen), the notebook entry (notebook), the
dependency lock (lock).

Imports: only itself (and, through select, the exercise files). Never the runtime, the benchmarks or the book.
"""
