import sys

from qatune.cli import entry

sys.exit(entry())
