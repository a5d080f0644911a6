"""A job from its command line to its record: the config composed and checked once
(:mod:`.config`, :mod:`.settings`), where it starts (:mod:`.start`), the train and checkpoint jobs
the entry points run (:mod:`.jobs`, :mod:`.entry`), and what the console and output folder show
(:mod:`.reporting`)."""
