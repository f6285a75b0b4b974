"""How a model answers, the pieces every kind of QA is answered with: decoding (generate.py: batched, grounded in the
passage, a grading sheet's fields chosen), spans and heads, the metrics of an answer (metrics.py, field_metrics.py,
their records: metric_records.py), a run's model loaded (run_model.py)."""
