"""Gradings shared by the selftest's modules within one pytest run (not a test module).

tests/test_contracts.py grades each exercise's reference on COURSE_SEED 1-4 and keeps seed 1's grading here;
tests/test_exercises.py then takes it as its reference grading instead of grading the reference once more (one
grading of 10-60 s per exercise on CI's two cores). Run on its own, tests/test_exercises.py grades the reference
itself, on a random seed.
"""

REFERENCE: dict = {}      # exercise id -> the reference's Grade on seed 1
