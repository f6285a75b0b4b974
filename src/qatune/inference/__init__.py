"""A trained model answering: ``qatune generate`` (generate.py; a whole sheet: graded_sheets.py), ``qatune eval`` and
its metrics (evaluate.py, metrics.py, field_metrics.py), ``eval --compare`` (compare.py; its command and files:
compare_report.py), a run's model loaded for them (run_model.py)."""
