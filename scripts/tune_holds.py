"""Rewrite mkgen/plan/holds.json, the tuned held-refill choices (mkgen/plan/holds.py) and
mkgen/plan/kvtiles.json, the KV tiles (mkgen/plan/tuning.py).

    python scripts/tune_holds.py                                # score every entry again
    python scripts/tune_holds.py kimi-k3 2x2x4 rows=8           # add a build, then rewrite
    python scripts/tune_holds.py muse-spark-1.2 2x2x1 quant=experts=nvfp4
    python scripts/tune_holds.py kimi-k3 2x2x4 rows=8 draft=kimi-k3-mtp   # a drafted build
    python scripts/tune_holds.py kimi-k3 2x2x4 rows=8 draft=kimi-k3-mtp fuse_draft=true

Run it after a change to the cost model's constants, the schedule or the walk: the
entries' digests or choices go stale, and tests/test_holds.py says which.
"""

from __future__ import annotations

import sys

from mkgen.kinds import default_registry
from mkgen.plan.tuning import main

if __name__ == "__main__":
    main(sys.argv[1:], default_registry())
