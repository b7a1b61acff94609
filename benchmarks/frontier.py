#!/usr/bin/env python
"""HumanEval pass@1 vs tokens/s for AR, SD, FSD and FSD-strict on a target/draft pair.

Run from the repository root, e.g. a CPU-sized subset:

    nice -n 10 python benchmarks/frontier.py --problems 20 --rules ar,sd,fsd --divergences js,rkl \
        --thresholds 'js=0.1,0.2,0.3,0.5;rkl=0.25,0.5,1,2' --max-new-tokens 384 \
        --out benchmarks/results/frontier-cpu

and the full sweep on a GPU: `python benchmarks/frontier.py --all --out benchmarks/results/frontier-gpu`.
Stopped runs resume from <out>/results.jsonl. See fsd_ext/bench/__init__.py for what is measured.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsd_ext.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
