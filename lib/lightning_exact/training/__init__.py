"""Distributed and exact training: the Trainer assembled from config (:mod:`.trainer`), ranks and
launchers (:mod:`.distributed`), N ranks training the weights of one (:mod:`.exact`), FSDP
(:mod:`.sharded`), precisions (:mod:`.precision`), and every logged point at its global step
(:mod:`.steps`, :mod:`.train_points`)."""
