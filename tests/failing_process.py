"""One process of a multi-process run made to fail (or to stay busy) at a chosen point, for the tests.

``injected(tmp_path, ...)`` returns the environment for ``qatune train --num-processes N``: a sitecustomize.py on
PYTHONPATH that, in the process of the given rank, replaces a function of a qatune module once that module has
loaded. ``raise`` writes the time of the failure into ``tmp_path/failed_at`` and raises
``RuntimeError('injected failure in NAME')``; ``sleep`` keeps the process busy outside any collective for 10
minutes (as a process evaluating its own share of held-out rows is); ``false`` returns False (a check that never
passes).
"""

import json
import os

SITECUSTOMIZE = '''
import importlib.abc, importlib.util, json, os, sys, time

def _replaced(name, action, failed_at):
    def replacement(*args, **kwargs):
        if action == "false":
            return False
        if action == "raise":
            with open(failed_at, "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError(f"injected failure in {name}")
        time.sleep(600)
    return replacement

class _AfterLoad(importlib.abc.MetaPathFinder):
    def __init__(self, module, name, replacement):
        self.module, self.name, self.replacement = module, name, replacement

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            setattr(module, self.name, self.replacement)

        spec.loader.exec_module = exec_module
        return spec

for rank, where, action in json.loads(os.environ.get("QATUNE_TEST_INJECT", "[]")):
    if os.environ.get("RANK") == str(rank):
        module, name = where.split(":")
        sys.meta_path.insert(0, _AfterLoad(module, name, _replaced(name, action, os.environ["QATUNE_TEST_FAILED_AT"])))
'''


def injected(tmp_path, *actions):
    """The environment of a run whose processes take ``actions``: (rank, "module:function", "raise" | "sleep")."""
    folder = tmp_path / "inject"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": str(folder), "QATUNE_TEST_INJECT": json.dumps(actions),
            "QATUNE_TEST_FAILED_AT": str(tmp_path / "failed_at")}


def error_lines(stderr):
    """The lines of ``stderr`` that report an error (the one line a failure must end in)."""
    return [line for line in stderr.splitlines() if line.startswith(("error:", "internal error:"))]
