"""Ulysses attention's exchange, resolved for a call: `auto` becomes the planner's pick.

The spellings, `Exchange` and `parse_exchange` are data every floor agrees on (`xstage.spec.exchange`,
re-exported here). `resolve_auto` asks the planner's policy (`xstage.sched.policy.choose_exchange`)
for the call's shape, group size, store path and dtype, and returns its choice; the policy caches it
per shape and logs it (`xstage.decisions`).
"""

from __future__ import annotations

from xstage.dtypes import dtype_name
from xstage.errors import InputError
from xstage.sched.exchange import ExchangeCosts
from xstage.sched.policy import Decision, choose_exchange
from xstage.spec.exchange import CORES, CUTS, MECHANISMS, SIGNALLED, Exchange, parse_exchange
from xstage.spec.ulysses import UlyssesPlan


def decide_exchange(plan: UlyssesPlan, dtype, path: str, costs: ExchangeCosts | None = None,
                    calibration=None) -> Decision:
    """The planner's `Decision` for this call's `auto` (see `xstage.sched.policy.choose_exchange`);
    `costs` and `calibration` None: a calibration of the setting `XSTAGE_CALIBRATION`, else the
    embedded one."""
    return choose_exchange(plan.heads, plan.head_dim, plan.seq_total, plan.world, path=path,
                           dtype=dtype if isinstance(dtype, str) else dtype_name(dtype), costs=costs,
                           calibration=calibration)


def resolve_auto(plan: UlyssesPlan, dtype, path: str, device=None, costs: ExchangeCosts | None = None,
                 calibration=None) -> Exchange:
    """The planner's exchange for this call; never `auto` itself (`decide_exchange`)."""
    choice = parse_exchange(decide_exchange(plan, dtype, path, costs, calibration).choice)
    if choice.mechanism == "auto":
        raise InputError("exchange 'auto': the planner answered 'auto'; it must name a mechanism")
    return choice


__all__ = ["CORES", "CUTS", "MECHANISMS", "SIGNALLED", "Exchange", "decide_exchange", "parse_exchange", "resolve_auto"]
