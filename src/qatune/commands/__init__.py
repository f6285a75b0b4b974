"""What the commands do beyond calling one library function: ``qatune check`` (check.py), ``qatune init``
(init.py), ``qatune env`` (environment.py), ``qatune eval``'s choice of model and its lines (evaluation.py),
launching processes and machines (launch.py, torchrun.py), and how a command's process ends (process.py)."""
