"""A trained run asked and judged: one question (asking.py: ``qatune generate RUN "question"``), a whole sheet
answered back into its cells (graded_sheets.py), ``qatune eval`` and its files (evaluate.py), ``eval --compare``
(compare.py; its command and files: compare_report.py). Each asks the run's kind (:mod:`qatune.kinds`) how it
answers."""
