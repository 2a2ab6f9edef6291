"""Tier 1's benchmarks in one run: the heuristic chain against datatrove, then the encoder against sentence-transformers.

    python bench/static.py [--docs N]

Both halves run in this one process, one after the other, on real documents
from this installation (man pages, Python reference topics, package
metadata, standard-library modules, README/NEWS files and package long
descriptions), so the comparisons are side by side. Tier 1's precision and
recall on the labelled pool are bench/tier1_pool.py.
See bench/heuristics.py and bench/encoder.py for each half on its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import encoder  # noqa: E402  (bench/encoder.py)
import heuristics  # noqa: E402  (bench/heuristics.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=512, help="documents for the encoder half")
    args = parser.parse_args()
    print("## Heuristics: assay chain vs datatrove\n")
    heuristics.main([])
    print("\n## Encoder: assay vs sentence-transformers\n")
    encoder.main(["--docs", str(args.docs)])


if __name__ == "__main__":
    main()
