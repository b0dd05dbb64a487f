"""``python -m vega.modelproc FD SLOT_FD``: a model process (started by the executor)."""

import sys

from vega.modelproc.child import main

sys.exit(main(sys.argv[1:]))
