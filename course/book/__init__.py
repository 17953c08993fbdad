"""The book builder: the site and PDF (build, with MkDocs hooks and extra.css), appendix A derived from the
cards (appendix; `python -m course.book` rewrites it), the SVG figures (figures; `python -m course.book.figures`),
the measured tables and numbers filled in from committed result files (results).

Imports: itself and the grader's registry, select and cards. Never the runtime or the benchmarks.
"""
