"""The work of a persistent kernel as data: per CTA an ordered list of tasks.

A `Task` computes for `compute_ns`, then (in its epilogue) issues remote stores: `stores` maps a
destination to bytes. It may start only after every task in `deps` has finished (its stores issued:
the producer's epilogue writes are what the consumer reads). Destinations map to store paths through
`KernelWork.dest_path`: a destination without a path (the local rank) costs no store time.

Example (two CTAs, the second waits for the first's task):

    work = KernelWork(
        ctas=[[Task("l1.0", 1000.0)], [Task("l2.0", 800.0, stores={1: 65536}, deps=("l1.0",))]],
        dest_path={1: "host"},
    )
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from xstage.errors import InputError


def require_positive_ints(obj, names, what: str) -> None:
    """Raise `InputError` unless every attribute `names` of `obj` is an int >= 1 (configs' checks)."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"{what} {name}={v!r}: must be a positive integer")


@dataclass(frozen=True)
class Task:
    name: str
    compute_ns: float
    stores: Mapping[int, int] = field(default_factory=dict)
    deps: tuple[str, ...] = ()
    kind: str = ""
    # Share of the compute time bound by loads from HBM: what a full store path slows down
    # (`xstage.model.interference`); 0 for compute-bound or L2-resident work.
    mem_share: float = 0.0

    def __post_init__(self):
        if not self.compute_ns >= 0:
            raise InputError(f"task {self.name}: compute_ns must be >= 0, got {self.compute_ns}")
        if isinstance(self.mem_share, bool) or not isinstance(self.mem_share, (int, float)) \
                or not 0.0 <= self.mem_share <= 1.0:
            raise InputError(f"task {self.name}: mem_share must be in [0, 1], got {self.mem_share}")
        for dest, nbytes in self.stores.items():
            if nbytes < 0:
                raise InputError(f"task {self.name}: stores[{dest}] must be >= 0 bytes, got {nbytes}")

    @property
    def store_bytes(self) -> int:
        return int(sum(self.stores.values()))


@dataclass
class KernelWork:
    """Per-CTA task lists; CTA i runs on SM `cta_sm[i]` (default: one CTA per SM).

    `queue` (optional) is a shared task list in a dependency-respecting order: a CTA whose own list
    is done takes the next queued task (a kernel whose CTAs fetch tasks with an atomic counter).
    Such a kernel has empty per-CTA lists and everything in the queue. `occupancy` (optional) scales a
    computing task's time by the share of CTAs computing at each moment."""

    ctas: Sequence[Sequence[Task]]
    dest_path: Mapping[int, str] = field(default_factory=dict)
    cta_sm: Sequence[int] | None = None
    queue: Sequence[Task] = ()
    # Factor on every task's compute time given the share of CTAs computing (0 < share <= 1): tiles run
    # faster while fewer SMs compute beside them (`xstage.sched.ordercost.OrderEffect.occupancy_factor`).
    # None: compute times are fixed.
    occupancy: Callable[[float], float] | None = None

    def __post_init__(self):
        if not self.ctas:
            raise InputError("work.ctas: at least one CTA is needed")
        if self.occupancy is not None and not callable(self.occupancy):
            raise InputError(f"work.occupancy: expected a function of the share of CTAs computing, got "
                             f"{type(self.occupancy).__name__}")
        if self.cta_sm is None:
            self.cta_sm = list(range(len(self.ctas)))
        if len(self.cta_sm) != len(self.ctas):
            raise InputError(f"work.cta_sm: {len(self.cta_sm)} entries for {len(self.ctas)} CTAs")
        names = [t.name for cta in self.ctas for t in cta] + [t.name for t in self.queue]
        if len(set(names)) != len(names):
            raise InputError("work: task names must be unique")
        known = set(names)
        for cta in [*self.ctas, self.queue]:
            for t in cta:
                missing = [d for d in t.deps if d not in known]
                if missing:
                    raise InputError(f"task {t.name}: unknown dependencies {missing}")

    def all_tasks(self) -> list[Task]:
        """Every task: the per-CTA lists, then the shared queue."""
        return [t for cta in self.ctas for t in cta] + list(self.queue)

    @property
    def n_tasks(self) -> int:
        return sum(len(c) for c in self.ctas) + len(self.queue)

    def sms(self) -> list[int]:
        return sorted(set(self.cta_sm))

    def paths(self) -> list[str]:
        return sorted(set(self.dest_path.values()))
