"""Hydra multiruns: each sweep job's folder, record and result (:mod:`.jobs`), and the sweep's
summary at its end (:mod:`.report`)."""
