"""Add the rows of a new `xstage bench ulysses --grid calibration` run to a calibration CSV.

Rows of the new run replace rows of the same configuration and variant (heads, dim, tokens, P, path,
variant); the rest of the old file is kept. Writes atomically with `\n` line ends; refuses files whose columns differ.

    python3 benchmarks/experiments/merge_calibration.py OLD.csv NEW.csv -o MERGED.csv
"""

from __future__ import annotations

import argparse
import csv

from xstage.errors import InputError
from xstage.results.io import atomic_open, read_rows

KEY = ("heads", "dim", "tokens", "P", "path", "variant")


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    if not new:
        raise InputError("the new calibration has no rows: nothing to merge")
    if old and new and list(old[0]) != list(new[0]):
        raise InputError(f"the two calibrations have different columns: {list(old[0])} vs {list(new[0])}")
    fresh = {tuple(str(r[k]) for k in KEY) for r in new}
    return [r for r in old if tuple(str(r[k]) for k in KEY) not in fresh] + list(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)
    old, new = read_rows(args.old), read_rows(args.new)
    rows = merge(old, new)
    # `\n` line ends, as the embedded calibration has them: a merge adds its rows to the diff, nothing else
    with atomic_open(args.out, newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(f"{len(old)} + {len(new)} rows -> {len(rows)} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
