"""What a project's tests share with the library's: real jobs run as a user runs them
(:mod:`.processes`), what they left read back (:mod:`.records`), servers started and stopped by a
test (:mod:`.servers`), instruments that stop a job at a chosen step (:mod:`.instruments`), the
daily-set convention and fixtures (:mod:`.plugin`, with the project's :mod:`.harness`), and the
conformance checks a project runs on its own task (:mod:`.conformance`)."""
