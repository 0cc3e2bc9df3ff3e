"""`python -m mlaserve`: the `mlaserve` command, found the way the installed command finds it.

`-m` puts the current directory first on sys.path, and the project's packages have plain names
(`server`, `models`, `engine`, `kernels`, ...): a `server.py` or a `models/` folder where the user
stands would be imported in their place. The installed command does not look there, so neither does
this, unless the current directory is the project's own checkout.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and not sys.flags.safe_path and os.path.abspath(sys.path[0] or os.curdir) != _ROOT:
    del sys.path[0]

from mlaserve.cli import main  # noqa: E402  (after the path is settled)

sys.exit(main())
