import sys

from mlaserve.cli import main

sys.exit(main())
