"""Checkpoints and resume: atomic checkpoints and their checks (:mod:`.checkpoint`), a stopped job
resumed exactly where it stopped (:mod:`.resume`), stop signals and dead ranks
(:mod:`.shutdown`)."""
