"""A trained drafter for the serving engines: the export's files written and read back (``layout``), with the
modeling code it carries (``hf_modeling``), the directory it may replace (``destination``), a run's newest
checkpoint exported (``from_checkpoint``) or the step-0 drafter (``untrained``), and the command each engine
serves it with (``serving``)."""
