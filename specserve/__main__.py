"""``python -m specserve [serve MODEL --flags | overrides]``: the ``specserve`` command."""

import sys

from specserve.cli import serve_main

sys.exit(serve_main())
