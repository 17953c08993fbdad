"""The course's glue, in four rooms; no exercise logic lives here (see mine/ and solutions/).

    cli.py    `./check.sh ...`: the one entry point; the only module that reaches into every room
    grader/   registry, implementation selection, progress, running checks, cards, stubs, notebook entry
    runtime/  what learners use but do not write: run, the HTTP server entry, the TP process layout
    bench/    the benchmarks: the engine, Track K's kernels, the HTTP server
    book/     the book builder: site and PDF, appendix A, figures

`from course import use` gives a notebook or script the checker's selection (course/grader/notebook.py).
"""

from .grader.notebook import use

__all__ = ["use"]
