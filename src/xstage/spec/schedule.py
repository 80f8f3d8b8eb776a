"""Schedule tables: the task order of the fused MoE kernel as plain data.

Problem: one persistent kernel runs three kinds of tasks over *units* (one `block_m` row block of
one local expert): DISPATCH (pull the unit's token rows from their source ranks), LINEAR1 (one
`block_n1` slab of gate/up columns + SwiGLU) and LINEAR2 (one `block_n2` slab of output columns,
whose epilogue pushes rows to the tokens' source ranks: the remote-store bursts). Where the LINEAR2
tasks sit between compute decides how the stores drain (burst-gap.md).

Algorithm: a schedule is a global task list. The kernel either lets free CTAs take its tasks in
that order (dynamic, the default) or gives task g to CTA `g % num_ctas` (round-robin, the `tasks` /
`cta_start` split below); each CTA runs its tasks in global order. A task waits only on its unit's
readiness counter (DISPATCH -> 1, every LINEAR1 -> +1), and every dependency appears earlier in the
global list, so with co-resident CTAs no order can deadlock. Every order then has its dispatches
hoisted ahead of their units' LINEAR1 tasks (`hoist_dispatch`). Names:

- `expert_wave`: waves of whole experts with >= 2 x num_ctas LINEAR1 tasks each; per wave all
  DISPATCH+LINEAR1 tasks, then all LINEAR2 tasks (DeepGEMM's Expert-Wave order).
- `interleaved`: LINEAR1 of wave 0 as warm-up, then LINEAR1 tasks of wave w+1 alternate one for one
  with LINEAR2 tasks of wave w.
- `lag:k`: LINEAR1 of units 0..k, then LINEAR2(unit i) followed by LINEAR1(unit i+k+1), so LINEAR2 of
  unit i runs after LINEAR1 of unit i+k.
Names chosen per call resolve to one of these orders when a call is planned: `model_guided`, the
planner's pick for the call (`xstage.sched.policy.choose_schedule`), and any chooser a user adds with
`register_schedule(name, chooser=...)`. Custom orders register with `register_schedule(name, fn)`.

Example:
    >>> from xstage.spec.schedule import make_schedule
    >>> s = make_schedule("lag:1", unit_expert=[0, 0, 1], num_ctas=2, n1=2, n2=1)
    >>> s.num_tasks, s.cta_start.tolist()
    (12, [0, 6, 12])
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from xstage.bounds import INT32_MAX, MAX_SMS
from xstage.errors import InputError

DISPATCH, LINEAR1, LINEAR2 = 0, 1, 2
KIND_NAMES = ("dispatch", "linear1", "linear2")
TASK_COLS = 8
# Sizes a schedule can hold: CTAs of one launch (SMs x resident CTAs per SM), N tiles of one unit
# (2 x 65536 intermediate columns in 16-column tiles), and tasks in its int32 table.
MAX_CTAS = MAX_SMS * 32
MAX_TILES_PER_UNIT = 1 << 13
MAX_TASKS = INT32_MAX


class PoolTooSmallError(InputError):
    """A schedule needs more units in flight than the row pool holds (a larger pool or another order)."""
COLUMNS = ("kind", "unit", "n_block", "expert", "m_block", "wait_target", "global_index", "store_rows")


@dataclass(frozen=True)
class Schedule:
    """Per-CTA task lists, concatenated.

    tasks:     [num_tasks, 8] int32, columns `COLUMNS`: kind, unit, n block, local expert, m block
               (within the expert), readiness value awaited, position in the global order, rows
               stored (LINEAR2: the unit's valid rows; their bytes are `store_rows * block_n2 * elem`).
    cta_start: [num_ctas + 1] int32, CTA c runs rows `cta_start[c]:cta_start[c+1]`.
    dest_rows: [num_tasks, R] int32 or None, rows each task stores toward each destination rank
               (LINEAR2 only; from the routing when `make_schedule` gets `unit_dest_rows`).
    """

    name: str
    num_ctas: int
    n1: int
    n2: int
    num_units: int
    tasks: np.ndarray
    cta_start: np.ndarray
    dest_rows: np.ndarray | None = None

    def store_bytes(self, block_n2: int, elem_bytes: int) -> np.ndarray:
        """Bytes each task stores remotely: per destination `[num_tasks, R]` if known, else `[num_tasks]`."""
        rows = self.dest_rows if self.dest_rows is not None else self.tasks[:, 7]
        return rows.astype(np.int64) * block_n2 * elem_bytes

    @property
    def num_tasks(self) -> int:
        return int(self.tasks.shape[0])

    def global_order(self) -> np.ndarray:
        """Tasks sorted by their global index: the order a single CTA would run them."""
        return self.tasks[np.argsort(self.tasks[:, 6], kind="stable")]

    def cta_tasks(self, cta: int) -> np.ndarray:
        return self.tasks[self.cta_start[cta] : self.cta_start[cta + 1]]


Task = tuple[int, int, int]  # kind, unit, n_block


def _unit_tasks(kind: int, u: int, n: int) -> list[Task]:
    return [(kind, u, nb) for nb in range(n)]


def _first(u: int, n1: int) -> list[Task]:
    return [(DISPATCH, u, 0)] + _unit_tasks(LINEAR1, u, n1)


def _waves(unit_expert: Sequence[int], n1: int, num_ctas: int, max_units: int | None = None) -> list[list[int]]:
    """Waves of whole experts with at least `2 * num_ctas` LINEAR1 tasks each; with `max_units` (the
    units a bounded row pool lets be in flight) a wave holds at most that many units, splitting an
    expert where it must."""
    waves: list[list[int]] = [[]]
    for u, e in enumerate(unit_expert):
        boundary = u == 0 or unit_expert[u - 1] != e
        full = max_units is not None and len(waves[-1]) >= max_units
        if full or (boundary and len(waves[-1]) * n1 >= 2 * num_ctas):
            waves.append([])
        waves[-1].append(u)
    return [w for w in waves if w]


def _expert_wave(unit_expert, n1, n2, num_ctas, arg, pool_units=None) -> list[Task]:
    # A wave's dispatches run ahead into the previous wave's LINEAR2 tasks: two waves share the pool.
    order: list[Task] = []
    for wave in _waves(unit_expert, n1, num_ctas, max(1, pool_units // 2) if pool_units else None):
        for u in wave:
            order += _first(u, n1)
        for u in wave:
            order += _unit_tasks(LINEAR2, u, n2)
    return order


def _interleaved(unit_expert, n1, n2, num_ctas, arg, pool_units=None) -> list[Task]:
    # LINEAR1 of wave w+1 runs beside LINEAR2 of wave w, and wave w+2's dispatches run ahead: three waves.
    waves = _waves(unit_expert, n1, num_ctas, max(1, pool_units // 3) if pool_units else None)
    order: list[Task] = []
    for u in waves[0]:
        order += _first(u, n1)
    for w in range(len(waves)):
        l1 = [t for u in waves[w + 1] for t in _first(u, n1)] if w + 1 < len(waves) else []
        l2 = [t for u in waves[w] for t in _unit_tasks(LINEAR2, u, n2)]
        i = j = 0
        while i < len(l1) or j < len(l2):
            # One-for-one, but a dispatch rides along with the LINEAR1 task after it.
            if i < len(l1):
                order.append(l1[i])
                i += 1
                if order[-1][0] == DISPATCH and i < len(l1):
                    order.append(l1[i])
                    i += 1
            if j < len(l2):
                order.append(l2[j])
                j += 1
    return order


def _lag(unit_expert, n1, n2, num_ctas, arg, pool_units=None) -> list[Task]:
    # k + 2 units are in flight; a smaller pool is refused when the order is checked (`make_schedule`).
    k = int(arg)
    n_units = len(unit_expert)
    order: list[Task] = []
    for u in range(min(k + 1, n_units)):
        order += _first(u, n1)
    for i in range(n_units):
        order += _unit_tasks(LINEAR2, i, n2)
        if i + k + 1 < n_units:
            order += _first(i + k + 1, n1)
    return order


_BUILTIN: dict[str, Callable] = {"expert_wave": _expert_wave, "interleaved": _interleaved, "lag": _lag}
# Orders and choosers a user registers (`register_schedule`); only user code writes them.
_REGISTRY: dict[str, Callable] = dict(_BUILTIN)
_CHOOSERS: dict[str, Callable] = {}
# The planner's pick per call: resolved by the kernel's caller through `xstage.sched.policy`.
PLANNED = "model_guided"

# The orders the planner ranks, the benchmark grids measure and `plan validate` checks picks over.
CANDIDATES = ("expert_wave", "interleaved", "lag:1", "lag:2", "lag:4", "lag:8", "lag:16")


def register_schedule(name: str, fn: Callable | None = None, *, chooser: Callable | None = None) -> None:
    """Add an order `fn(unit_expert, n1, n2, num_ctas, arg, pool_units=None) -> [(kind, unit, n_block),
    ...]` (`pool_units`: the units the row pool holds at once, None for no bound), or a
    `chooser(buf, tokens, num_ctas, pacing) -> schedule name` that picks one of the orders per call."""
    if not isinstance(name, str) or not name.isidentifier():
        raise InputError(f"schedule name {name!r}: must be an identifier")
    if name == PLANNED or name in _BUILTIN:
        raise InputError(f"schedule name {name!r}: a built-in name; choose another")
    if (fn is None) == (chooser is None):
        raise InputError(f"register_schedule({name!r}): give exactly one of an order function or a chooser")
    (_REGISTRY if fn is not None else _CHOOSERS)[name] = fn or chooser


def schedule_names() -> list[str]:
    """Every known name (`lag` takes `:k`)."""
    return sorted([*_REGISTRY, *_CHOOSERS, PLANNED])


def per_call(name) -> bool:
    """Whether `name` is chosen per call (`model_guided`, or a user's chooser) rather than an order."""
    return isinstance(name, str) and (name == PLANNED or name in _CHOOSERS)


def chooser(name: str) -> Callable | None:
    """The chooser a user registered under `name`, or None (an order, `model_guided`, or unknown)."""
    return _CHOOSERS.get(name)


def check_schedule(name: str) -> str:
    """`name` if it names an order (`lag:k` included) or a name chosen per call; else `InputError`."""
    if per_call(name):
        return name
    _parse(name)
    return name


_PARSED: dict[str, tuple[str, str]] = {}  # names parsed before: every call parses its order a few times


def _parse(name: str):
    hit = _PARSED.get(name) if isinstance(name, str) else None
    # Still an order (a chooser registered since, or an entry removed, would change the answer).
    if hit is not None and hit[0] in _REGISTRY and hit[0] not in _CHOOSERS:
        return hit
    if not isinstance(name, str):
        raise InputError(f"schedule {name!r}: must be a string such as 'lag:4'")
    base, _, arg = name.partition(":")
    if per_call(base) and not arg:
        raise InputError(f"schedule {name!r}: chosen per call; resolve it with its chooser first")
    if base not in _REGISTRY:
        raise InputError(f"schedule {name!r}: unknown; known: {schedule_names()} (lag takes ':k')")
    if base == "lag":
        if not arg.isdigit():
            raise InputError(f"schedule {name!r}: lag needs a non-negative integer, e.g. 'lag:2'")
    elif arg:
        raise InputError(f"schedule {name!r}: {base} takes no argument")
    if len(_PARSED) < 1024:  # bounded: names such as lag:k are many
        _PARSED[name] = (base, arg)
    return base, arg


def hoist_dispatch(order: list[Task], lead: int, pool_units: int | None = None) -> list[Task]:
    """Move each DISPATCH `lead` positions ahead of its unit's first LINEAR1 (or to the front).

    In the orders above a dispatch sits right before its unit's LINEAR1 tasks, so with many CTAs
    those tasks start together with the dispatch and wait for it. Tasks start in global order about
    `num_ctas` at a time, so a lead of two rounds lets the rows arrive before they are needed. Only
    dispatches move (they depend on nothing), so every dependency still comes earlier.

    With a row pool of `pool_units` units, unit u reuses the rows of unit u - pool_units: its dispatch
    also stays after that unit's last LINEAR2 (the slot is free then), so the wait for the slot is a
    dependency on earlier tasks too. An order that needs a unit's LINEAR1 before that point cannot run
    in the pool (`make_schedule` refuses it)."""
    if lead <= 0 and not pool_units:
        return list(order)
    rest = [t for t in order if t[0] != DISPATCH]
    first_l1: dict[int, int] = {}
    last_l2: dict[int, int] = {}
    for i, (kind, u, _nb) in enumerate(rest):
        if kind == LINEAR1:
            first_l1.setdefault(u, i)
        elif kind == LINEAR2:
            last_l2[u] = i
    keyed = [((i, 1), t) for i, t in enumerate(rest)]
    for t in order:
        if t[0] != DISPATCH:
            continue
        u = t[1]
        pos = max(0, first_l1.get(u, len(rest)) - max(0, lead))
        if pool_units and u >= pool_units:
            pos = max(pos, last_l2.get(u - pool_units, -1) + 1)
        keyed.append(((pos, 0), t))
    return [t for _key, t in sorted(keyed, key=lambda kt: kt[0])]


def make_schedule(name, unit_expert, num_ctas, n1, n2, unit_rows=None, block_m=None,
                  unit_dest_rows=None, dispatch_lead: int | None = None, pool_units: int | None = None) -> Schedule:
    """The schedule `name` for units whose local experts are `unit_expert` (in unit order).

    `unit_rows` (optional, valid rows per unit) fills the `store_rows` column; `block_m` is used
    otherwise. `unit_dest_rows` (optional `[units, R]`, rows of each unit per destination rank) fills
    `dest_rows`. Dispatches are hoisted `dispatch_lead` positions ahead of their unit's first LINEAR1
    (default two rounds of CTAs, `2 * num_ctas`; 0 keeps the named order as is). `pool_units` bounds
    the units whose rows are held at once (a row pool reused in unit order: unit u takes the slot of
    unit u - pool_units once that unit's LINEAR2 tasks are done); None holds every unit. Raises
    `InputError` for unknown names, non-integer or non-positive sizes, negative expert ids or row
    counts, and an order that needs more units in flight than the pool holds.
    """
    base, arg = _parse(name)
    num_ctas = _integer("num_ctas", num_ctas, 1, MAX_CTAS)
    n1, n2 = (_integer(label, v, 1, MAX_TILES_PER_UNIT) for label, v in (("n1", n1), ("n2", n2)))
    unit_expert = _integers("unit_expert", unit_expert, 0, INT32_MAX)
    if len(unit_expert) * (1 + n1 + n2) > MAX_TASKS:
        raise InputError(f"unit_expert: {len(unit_expert)} units x {1 + n1 + n2} tasks each are more than the "
                         f"{MAX_TASKS} tasks an int32 task table holds")
    if unit_rows is not None:
        unit_rows = _integers("unit_rows", unit_rows, 0, INT32_MAX)
        if len(unit_rows) != len(unit_expert):
            raise InputError(f"unit_rows: {len(unit_rows)} entries for {len(unit_expert)} units (one per unit)")
    if block_m is not None:
        block_m = _integer("block_m", block_m, 1, INT32_MAX)
    if dispatch_lead is not None:
        dispatch_lead = _integer("dispatch_lead", dispatch_lead, 0)
    if pool_units is not None:
        pool_units = _integer("pool_units", pool_units, 1)
        if pool_units >= len(unit_expert):
            pool_units = None  # every unit has its own rows: nothing is reused
    order = _REGISTRY[base](unit_expert, n1, n2, num_ctas, arg, pool_units=pool_units)
    if len(order) != len(unit_expert) * (1 + n1 + n2) or len(set(order)) != len(order):
        raise InputError(f"schedule {name!r}: must list every task of every unit exactly once")
    order = hoist_dispatch(order, 2 * int(num_ctas) if dispatch_lead is None else int(dispatch_lead), pool_units)
    n_units = len(unit_expert)
    first_of_expert = {}
    for u, e in enumerate(unit_expert):
        first_of_expert.setdefault(e, u)
    rows = [block_m or 0] * n_units if unit_rows is None else [int(r) for r in unit_rows]
    table = np.zeros((len(order), TASK_COLS), dtype=np.int32)
    for g, (kind, u, nb) in enumerate(order):
        e = unit_expert[u]
        wait = 0 if kind == DISPATCH else (1 if kind == LINEAR1 else 1 + n1)
        table[g] = (kind, u, nb, e, u - first_of_expert[e], wait, g, rows[u] if kind == LINEAR2 else 0)
    _check_order(table, n1, n2, pool_units, name)
    cta = np.arange(len(order)) % num_ctas
    perm = np.argsort(cta, kind="stable")
    counts = np.bincount(cta, minlength=num_ctas)
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tasks = table[perm].copy()
    dest = None
    if unit_dest_rows is not None:
        per_unit = _dest_rows(unit_dest_rows, n_units)
        dest = per_unit[tasks[:, 1]] * (tasks[:, :1] == LINEAR2)
    return Schedule(name, int(num_ctas), int(n1), int(n2), n_units, tasks, start, dest)


def _integer(label: str, v, minimum: int, maximum: int | None = None) -> int:
    """`v` as an int if it is an integer (Python, numpy or a 0-d integer tensor) in `minimum..maximum`."""
    need = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"
    try:
        if isinstance(v, (bool, np.bool_)):
            raise TypeError
        i = operator.index(v)
    except TypeError:
        raise InputError(f"{label}={v!r}: must be {need}") from None
    if i < minimum or (maximum is not None and i > maximum):
        raise InputError(f"{label}={v!r}: must be {need}")
    return i


def _integers(label: str, values, minimum: int, maximum: int | None = None) -> list[int]:
    """Every entry of `values` as an int (`_integer`); the error names the entry's position."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__") or getattr(values, "ndim", 1) != 1:
        raise InputError(f"{label}={values!r}: must be a sequence of integers >= {minimum}")
    return [_integer(f"{label}[{i}]", v, minimum, maximum) for i, v in enumerate(values)]


def _dest_rows(values, n_units: int) -> np.ndarray:
    """`unit_dest_rows` as an int32 `[units, R]` array: rows of each unit per destination, each in
    0..INT32_MAX."""
    try:
        a = np.asarray(values)
        ok = a.ndim == 2 and a.shape[0] == n_units and a.shape[1] >= 1 and a.dtype.kind in "iu"
    except (TypeError, ValueError):
        ok = False
    if not ok or a.min() < 0 or a.max() > INT32_MAX:
        raise InputError(f"unit_dest_rows: must be [{n_units}, R] integers in 0..{INT32_MAX} (rows of each unit per "
                         "destination rank)")
    return a.astype(np.int32)


def pool_too_small(name: str, pool_units: int, unit: int) -> PoolTooSmallError:
    """The refusal of an order whose unit `unit` would need its LINEAR1 before its pool slot is free
    (one wording for the host table and the device plan's up-front check)."""
    return PoolTooSmallError(f"schedule {name!r}: needs more than the {pool_units} units the row pool holds "
                             f"(unit {unit} must wait for unit {unit - pool_units}'s rows); use a larger pool_bytes "
                             "or a schedule with fewer units in flight")


def builtin_order(name: str) -> tuple[str, int] | None:
    """`(order, k)` when `name` is one of the orders shipped here, still registered as shipped
    (`lag:k` gives its k, the others 0); None for an order added with `register_schedule`.
    `InputError` for a name that is not an order (`check_schedule`)."""
    base, arg = _parse(name)
    if _REGISTRY.get(base) is not _BUILTIN.get(base):
        return None
    return base, int(arg) if arg else 0


def _check_order(table: np.ndarray, n1: int, n2: int = 0, pool_units: int | None = None, name: str = "") -> None:
    """Every task's dependencies come earlier in the global order (the deadlock-freedom invariant): a
    LINEAR1 after its unit's dispatch, a LINEAR2 after all its unit's LINEAR1, and with a row pool a
    dispatch after every LINEAR2 of the unit whose slot it takes."""
    seen: dict[int, int] = {}
    for kind, u, *_rest in table:
        u = int(u)
        have = seen.get(u, 0)
        need = 0 if kind == DISPATCH else (1 if kind == LINEAR1 else 1 + n1)
        if have < need:
            if kind == LINEAR1 and pool_units and u >= pool_units:
                raise pool_too_small(name, pool_units, u)
            raise InputError(f"schedule order: {KIND_NAMES[kind]} of unit {u} comes before its inputs")
        if kind == DISPATCH and pool_units and u >= pool_units and seen.get(u - pool_units, 0) < 1 + n1 + n2:
            raise InputError(f"schedule order: the dispatch of unit {u} comes before unit {u - pool_units} "
                             "frees its pool slot")
        seen[u] = have + 1
