"""Serving benchmark against a running server: `python benchmarks/serving.py --help`.

The same as `specserve bench serve`; see specserve/bench/serving.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.bench.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
