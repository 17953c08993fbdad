"""The grader and the glue: CLI, exercise registry, implementation selection, progress state.

No exercise logic lives here; see mine/ (the learner's files) and solutions/ (the references).
"""
