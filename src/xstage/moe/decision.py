"""What a fused MoE call runs when it leaves a choice to the planner, decided once per token bucket.

A call leaves two choices open: a schedule chosen per call (`model_guided`, the planner's pick, or any
name a user registered with `register_schedule(name, chooser=...)`) becomes an order, and
`pacing="auto"` becomes a store pacing. The planner's choices come from its policy, called here
directly (`xstage.sched.policy.choose_schedule`, `choose_pacing`), and each `MoEDecision` keeps the
planner's `Decision` objects behind it (`planner`: alternatives, predicted times, calibration). Each
answer is a `MoEDecision`, made once per (request, CTA count, token bucket) and cached on
the buffer, which fixes the shape, the group size and the store path. A cached decision costs one dict
lookup per call: no host synchronisation, no loop over units or tasks.

Token buckets (`token_bucket`): tokens per rank 0..1, 2, 3..4, 5..8, ..., (2^(b-1), 2^b], the last one
ending at the buffer's `num_max_tokens_per_rank`. A bucket is decided at its largest count, `hi`:
- the planner ranks only orders that fit the row pool under its routing at that count, and the
  largest count makes the most units, so an order it keeps fits the pool at every count below;
- counts that are powers of two (as the benchmarks and the planner's validation use) get exactly the
  decision the planner makes for them, and the last bucket is decided at `num_max_tokens_per_rank`;
- the planner's synthetic routing routes no row to a rank at the smallest counts of some shapes
  (`xstage.sched.moe.routes_rows`); the planner then answers with a defined choice (its first
  candidate order, unpaced) instead of a refusal. A call with no token (T = 0) shares the bucket of
  one token: on a real group such a rank still serves its peers' rows.

Forcing (`MoEBuffer.force_decision(tokens, variant)`): a `SCHEDULE[@PACING]` variant
(`xstage.moe.variant.Variant`) replaces what the planner would choose for every call in the buckets
of `tokens` (a count, or a range `(lo, hi)` from a bucket's start to a bucket's end). An order forces
the schedule of calls that ask for a per-call name; a pacing forces the pacing of calls that ask for
`"auto"`; a per-call name (`model_guided@off`) or no pacing (`lag:2`, `lag:2@auto`) leaves that part
to the planner. What a call names itself is never overridden.

Example:
    >>> from xstage.moe.decision import token_bucket
    >>> [token_bucket(t, 48) for t in (0, 1, 3, 4, 5, 33, 48)]
    [(0, 1), (0, 1), (3, 4), (3, 4), (5, 8), (33, 48), (33, 48)]
"""

from __future__ import annotations

from dataclasses import dataclass

from xstage.bounds import INT64_MAX, check_int
from xstage.errors import InputError
from xstage.sched.pacing import resolve_pacing
from xstage.sched.policy import Decision, buffer_config, choose_pacing, choose_schedule, pacing_of
from xstage.spec.pacing import AUTO, StorePacing, spec_of
from xstage.spec.schedule import PLANNED, builtin_order, check_schedule, chooser, per_call
from xstage.spec.variant import Variant

PLANNED_SOURCE, FORCED = "planned", "forced"
SOURCES = (PLANNED_SOURCE, FORCED)


def _bucket_hi(tokens: int, t_max: int) -> int:
    """The largest count of the bucket of `tokens` (see `token_bucket`)."""
    return min(1 << max(0, tokens - 1).bit_length(), t_max)


def _bucket_lo(hi: int) -> int:
    """The smallest count of the bucket that ends at `hi`."""
    return 0 if hi <= 1 else (1 << ((hi - 1).bit_length() - 1)) + 1


def token_bucket(tokens: int, t_max: int) -> tuple[int, int]:
    """`(lo, hi)`: the token counts per rank that share one decision with `tokens`, on a buffer of
    `t_max` tokens per rank: 0..1, then (2^(b-1), 2^b], the last bucket ending at `t_max`. Decided at
    `hi` (module docstring)."""
    t_max = check_int(t_max, "num_max_tokens_per_rank", 1, INT64_MAX, "tokens per rank in one call")
    tokens = check_int(tokens, "tokens", 0, t_max, "tokens per rank, at most num_max_tokens_per_rank")
    hi = _bucket_hi(tokens, t_max)
    return _bucket_lo(hi), hi


def token_buckets(t_max: int) -> list[tuple[int, int]]:
    """Every bucket of a buffer of `t_max` tokens per rank, in order."""
    out = [token_bucket(0, t_max)]
    while out[-1][1] < t_max:
        out.append(token_bucket(out[-1][1] + 1, t_max))
    return out


@dataclass(frozen=True)
class MoEDecision:
    """What the calls of one `request` (the call's `SCHEDULE@PACING`, e.g. `model_guided@auto`) run
    with `ctas` persistent CTAs and a token count in `bucket` (`lo, hi`, decided at `hi`): the order
    `schedule` and the store pacing `pacing` (None: unpaced). `source` is `"planned"` (the planner
    chose all it was asked) or `"forced"` (`MoEBuffer.force_decision` set a part of it). `planner`:
    the planner's decisions behind it (`xstage.sched.policy.Decision`: the pacing, then the schedule,
    each where the planner made it), with the alternatives' predicted times and the calibration used."""

    request: Variant
    bucket: tuple[int, int]
    ctas: int
    schedule: str
    pacing: StorePacing | None
    source: str
    planner: tuple[Decision, ...] = ()

    @property
    def variant(self) -> Variant:
        """What runs, as one `SCHEDULE@PACING` (the pacing's spec: `off`, or GB/s:KiB)."""
        return Variant(self.schedule, spec_of(self.pacing))

    def __str__(self) -> str:
        lo, hi = self.bucket
        ctas = f"{self.ctas} CTA" + ("s" if self.ctas != 1 else "")
        return f"tokens {lo}..{hi}, {ctas}: {self.request} -> {self.variant} ({self.source})"


def decide(buf, schedule: str, pacing, tokens: int, ctas: int) -> MoEDecision:
    """The decision of a call on `buf` that asks for `schedule` (a per-call name or an order) and
    `pacing` (`"auto"`, or a resolved pacing: a StorePacing or None) with `tokens` tokens on `ctas`
    CTAs: the cached one of its bucket, else made now (the planner runs at the bucket's largest count)
    and cached. Only calls that leave a choice open ask (a per-call name, or `"auto"`)."""
    check_schedule(schedule)  # before it is hashed: a malformed name gets its one line
    if not 0 <= tokens <= buf.T_max:
        token_bucket(tokens, buf.T_max)  # raises the one-line refusal
    hi = _bucket_hi(tokens, buf.T_max)
    key = (schedule, pacing, ctas, hi)
    hit = buf._decisions.get(key)
    if hit is not None:
        return hit
    # A call naming the pacing that an "auto" call of this bucket chose runs that call's order: its
    # decision asked the chooser this very question (or a forced order answered it for both).
    joint = buf._decisions.get((schedule, AUTO, ctas, hi))
    if joint is not None and joint.pacing == pacing:
        buf._decisions[key] = joint
        return joint
    made = buf._decisions[key] = _make(buf, schedule, pacing, ctas, hi)
    return made


def _make(buf, schedule: str, pacing, ctas: int, hi: int) -> MoEDecision:
    forced = buf._forced.get(hi)
    chosen_per_call = per_call(schedule)
    forced_schedule = forced is not None and chosen_per_call and not per_call(forced.schedule)
    forced_pacing = forced is not None and pacing == AUTO and forced.pacing not in (None, AUTO)
    order = forced.schedule if forced_schedule else (None if chosen_per_call else schedule)
    dtype = "fp8" if buf.fp8 else "bf16"
    cfg = buffer_config(buf, hi)  # what the planner predicts for this bucket
    planner: list[Decision] = []
    if forced_pacing:
        chosen = resolve_pacing(forced.pacing, buf.store_path, buf.R)
    elif pacing == AUTO:
        d = choose_pacing(cfg, buf.store_path, ctas, order, dtype=dtype,
                          calibration=buf.calibration)  # order None: jointly with the schedule
        planner.append(d)
        chosen = pacing_of(d, buf.store_path, buf.R)
    else:
        chosen = pacing
    if order is None:
        if schedule == PLANNED:
            d = choose_schedule(cfg, buf.store_path, ctas, chosen, dtype=dtype,
                                calibration=buf.calibration)
            planner.append(d)
            order = check_schedule(d.choice)
        else:  # a user's chooser
            order = check_schedule(chooser(schedule)(buf, hi, ctas, chosen))
    request = Variant(schedule, AUTO if pacing == AUTO else spec_of(pacing))
    return MoEDecision(request, (_bucket_lo(hi), hi), ctas, order, chosen,
                       FORCED if forced_schedule or forced_pacing else PLANNED_SOURCE, tuple(planner))


def _forced_buckets(buf, tokens) -> list[int]:
    """The `hi` of every bucket `tokens` names: one count, or a range `(lo, hi)` from a bucket's start
    to a bucket's end."""
    if isinstance(tokens, (tuple, list)):
        if len(tokens) != 2:
            raise InputError(f"tokens={tokens!r}: expected a token count or a range (lo, hi)")
        lo, hi = (check_int(t, "tokens", 0, buf.T_max, "tokens per rank, at most num_max_tokens_per_rank")
                  for t in tokens)
        buckets = token_buckets(buf.T_max)
        starts, ends = {b[0] for b in buckets}, {b[1] for b in buckets}
        if lo > hi or lo not in starts or hi not in ends:
            shown = ", ".join(f"{a}..{b}" for a, b in buckets)
            raise InputError(f"tokens={tuple(tokens)!r}: a range must run from a bucket's start to a bucket's "
                             f"end; this buffer's buckets are {shown}")
        return [b for _, b in buckets if lo <= b and _bucket_lo(b) <= hi]
    token_bucket(tokens, buf.T_max)  # refuses a bad count, naming `tokens`
    return [_bucket_hi(tokens, buf.T_max)]


def _check_forced_order(buf, name: str, his: list[int]) -> None:
    """Refuse an order that some routing in these buckets could not run in the buffer's row pool."""
    from xstage.moe.device_plan import pool_needed  # it builds on the fused call, which imports this module
    from xstage.spec.moe import max_units

    if builtin_order(name) is None:
        return
    units = max_units(buf.R, max(his), buf.K, buf.E_local, buf.cfg.block_m)
    if buf.pool_units < units and buf.pool_units < pool_needed(name):
        raise InputError(f"variant {name!r}: needs {pool_needed(name)} units of the row pool, which holds "
                         f"{buf.pool_units} (up to {units} units at {max(his)} tokens); use a larger pool_bytes or "
                         "an order with fewer units in flight")


def force(buf, tokens, variant) -> list[tuple[int, int]]:
    """Force `variant` for the buckets of `tokens` (`MoEBuffer.force_decision`); returns those buckets."""
    if isinstance(variant, str):
        try:
            variant = Variant.parse(variant)
        except InputError as exc:
            raise InputError(str(exc) if str(exc).startswith("variant") else f"variant {variant!r}: {exc}") from None
    elif not isinstance(variant, Variant):
        raise InputError(f"variant={variant!r}: expected SCHEDULE[@PACING] such as 'lag:2@off', or a Variant")
    his = _forced_buckets(buf, tokens)
    order = not per_call(variant.schedule)
    paced = variant.pacing not in (None, AUTO)
    if not order and not paced:
        raise InputError(f"variant {str(variant)!r}: forces nothing; name an order ('lag:2'), a pacing "
                         "('model_guided@off') or both ('lag:2@off')")
    if order:
        _check_forced_order(buf, variant.schedule, his)
    if paced:
        resolve_pacing(variant.pacing, buf.store_path, buf.R)  # a spec this path resolves, before storing it
    for hi in his:
        buf._forced[hi] = variant
    # Decisions made before in these buckets are made again, with the forced parts.
    for key in [k for k in buf._decisions if k[3] in his]:
        del buf._decisions[key]
    buf._steady.clear()  # the steady calls' resolved orders and pacings (`device_plan`) with them
    return [(_bucket_lo(hi), hi) for hi in his]


def cached(buf) -> list[MoEDecision]:
    """The decisions cached on `buf`, each once, by bucket, then request (`MoEBuffer.decisions`)."""
    unique = {id(d): d for d in buf._decisions.values()}.values()
    return sorted(unique, key=lambda d: (d.bucket, str(d.request), d.ctas))
