"""The top entries of the stage profiles `ASSAY_BENCH_PROFILE` wrote.

`python bench/profiling/top.py <dir> [n]`: for each `<stage>-<pid>.pstats`, the
functions with the most CPU time of their own, then with the most in all (callees
included).
"""

from __future__ import annotations

import pstats
import sys
from pathlib import Path


def main() -> None:
    folder, n = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 15
    for path in sorted(folder.glob("*.pstats")):
        stats = pstats.Stats(str(path))
        print(f"===== {path.stem}: {stats.total_tt:.1f} s CPU")  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(n)
        stats.sort_stats("cumulative").print_stats(n)


if __name__ == "__main__":
    main()
