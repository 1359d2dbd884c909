"""``python -m fp8linear.quantize SRC DST [...]``: the same as ``fp8linear quantize SRC DST [...]``."""

import sys

from ..cli import main

sys.exit(main(["quantize", *sys.argv[1:]]))
