"""The library's promises, checked on this project's own task (its tiny job,
``tests/task/tiny_job.py``): 2 ranks train the weights of 1 process, a stopped job resumes
exactly, training points every ``log_every_n_steps``, exact evaluation, no random op the library
cannot make exact. Slow: ``python -m pytest --full`` runs them (what each checks:
:mod:`lightning_exact.testing.conformance`)."""

from lightning_exact.testing.conformance import *  # noqa: F403  the checks, as tests of this project
