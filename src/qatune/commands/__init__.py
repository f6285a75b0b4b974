"""The commands that are neither training nor inference: ``qatune check`` (check.py), ``qatune init``
(init.py), ``qatune env`` (environment.py), and how a command's process ends (process.py)."""
