import sys

from qatune.cli import main

sys.exit(main())
