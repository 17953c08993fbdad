"""The grader and the glue: CLI, exercise registry, implementation selection, progress state.

No exercise logic lives here; see mine/ (the learner's files) and solutions/ (the references).
`from course import use` gives a notebook or script the checker's selection (course/notebook.py).
"""

from .notebook import use

__all__ = ["use"]
