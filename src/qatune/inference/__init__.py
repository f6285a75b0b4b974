"""A trained model answering: ``qatune generate`` (generate.py), ``qatune eval`` and its metrics (evaluate.py,
metrics.py), a run's model loaded for both (loading.py)."""
