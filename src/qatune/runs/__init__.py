"""Where a run is written: the run directory's layout and status (layout.py), the lock that keeps a second
process out (lock.py), and crash-safe writes of files and folders with their manifests (atomic.py).

Checkpoints are written by the training loop (:mod:`qatune.train.checkpoint`), model folders by
:mod:`qatune.model.folder`, both through atomic.py.
"""
