"""Would a share model of the two compute streams predict `overlap` better than `wave_done`? (CPU only)

The graph-replay trace (`benchmarks/results/h200-ulysses-overlap-trace/`, graph section) shows a block
started later taking most of the SMs from the block already running, where the planner's
`xstage.sched.exchange.wave_done` serves the block launched first. This replaces `wave_done` by a
variant in which, while two blocks have tiles left, the later-started one (the higher index on a tie)
takes `later` of each wave's free slots and the other the rest (`later` = 0 is `wave_done`), refits
the planner's coefficients on the embedded calibration for each `later`, and prints the in-sample
calibration errors per ranked exchange (median and p90 of |predicted - measured overhead| /
attention alone). It reads no grid the planner is judged on.

    PYTHONPATH=src python3 benchmarks/experiments/ulysses_share_model.py [LATER ...]   # default 0 0.3 0.5 0.7 0.9
"""

from __future__ import annotations

import math
import sys
from importlib import resources

import xstage.sched.exchange as exchange
from xstage.model import load_default_profile
from xstage.results.io import read_rows


def wave_done_shared(tiles, slots, tile_ns, block_ns=0.0, later=0.0):
    """`wave_done` with the free slots of each wave split between the (at most two) startable blocks."""
    n = len(tiles)
    left = [int(t) for t in tiles]
    start = [0.0 if i < 2 else None for i in range(n)]
    done = [0.0] * n
    free = {0.0: slots}
    pending = list(range(n))
    while pending:
        t = min(free)
        count = free.pop(t)
        ready = [i for i in pending if start[i] is not None and start[i] <= t]
        if len(ready) == 2 and later > 0:
            old, new = ready
            k_old = min(left[old], count - min(left[new], math.ceil(later * count)))
            give = {old: k_old, new: min(left[new], count - k_old)}
        else:
            give, c = {}, count
            for i in ready:
                give[i] = min(c, left[i])
                c -= give[i]
        for i, k in give.items():
            if k <= 0:
                continue
            left[i] -= k
            count -= k
            free[t + tile_ns] = free.get(t + tile_ns, 0) + k
            if left[i] == 0:
                done[i] = t + tile_ns + block_ns
                pending.remove(i)
                if i + 2 < n:
                    start[i + 2] = done[i]
        if count and pending:
            nxt = min([*free, *(start[i] for i in pending if start[i] is not None and start[i] > t)])
            free[nxt] = free.get(nxt, 0) + count
    return done


def main(argv=None) -> int:
    shares = [float(a) for a in (argv if argv is not None else sys.argv[1:])] or [0.0, 0.3, 0.5, 0.7, 0.9]
    assert wave_done_shared([6, 6, 2], 4, 1.0) == exchange.wave_done([6, 6, 2], 4, 1.0)
    with resources.as_file(resources.files("xstage.data") / exchange.CALIBRATION_CSV) as path:
        cal = read_rows(path)
    drain = load_default_profile("host").params.drain
    original = exchange.wave_done
    print("| later | exchange | median | p90 |\n|---|---|---|---|")
    try:
        for later in shares:
            exchange.wave_done = lambda tiles, slots, tile_ns, block_ns=0.0, _l=later: wave_done_shared(
                tiles, slots, tile_ns, block_ns, _l)
            costs = exchange.fit_exchange_costs(cal, drain=drain)
            for s in exchange.validate_exchange(cal, costs, exchange.CANDIDATES)[1]:
                print(f"| {later} | {s['exchange']} | {s['median_abs_overhead_error']:.2%} | "
                      f"{s['p90_abs_overhead_error']:.1%} |")
    finally:
        exchange.wave_done = original
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
