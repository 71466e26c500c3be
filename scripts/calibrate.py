"""Print the cost model's calibration tables (docs/cost-model.md): every measured row
beside the model's prediction, the bias, and the batch-1 breakdown.

    python scripts/calibrate.py
"""

from __future__ import annotations

from mkgen.kinds import default_registry
from mkgen.plan.calibration import batch1_breakdown, calibrate, format_table, summarise

if __name__ == "__main__":
    kinds = default_registry()
    table = calibrate(kinds)
    print(format_table(table))
    print(summarise(table).describe())
    for key, (pub, pred) in batch1_breakdown(kinds).items():
        print(f"{key:<26} published {pub:7.1f} us  predicted {pred:7.1f} us")
