"""Stage ids of device waits: one table of every id a kernel of xstage writes into an error word.

A kernel that waits on a flag owns a stage id; a wait that runs past its watchdog writes
`stage << 16 | peer` into the error word, and the host names the stage from this table
(`xstage.comm.stages.stage_name`). Ranges, so that kernels of different packages never collide:
1-15 comm core and the probe, 16-31 attention (Ulysses), 32-47 MoE, 48-127 free (a user's own kernels
name theirs with `xstage.comm.stages.register_stage`).
"""

STAGE_GENERIC = 1
STAGE_PROBE_FLAG = 2
STAGE_PROBE_TEST = 3
STAGE_BARRIER = 4
STAGE_REFUSED = 5
STAGE_ULYSSES_OUTPUT = 16
STAGE_L1_WAIT, STAGE_L2_WAIT, STAGE_COMBINE_DONE, STAGE_BUFFER_FREE, STAGE_STORE_PACING = 32, 33, 34, 35, 36
STAGE_POOL_SLOT = 37
STAGE_PLAN_BARRIER = 38  # the device plan's grid barrier (xstage.moe.device_plan)

STAGE_NAMES: dict[int, str] = {
    STAGE_GENERIC: "comm.wait",
    STAGE_PROBE_FLAG: "probe.peer_flag",
    STAGE_PROBE_TEST: "comm.test_wait",
    STAGE_BARRIER: "comm.barrier",
    STAGE_REFUSED: "comm.peer_refused_its_inputs",
    STAGE_ULYSSES_OUTPUT: "attention.ulysses_output",
    STAGE_POOL_SLOT: "moe.dispatch_waits_pool_slot",
    STAGE_L1_WAIT: "moe.linear1_waits_dispatch",
    STAGE_L2_WAIT: "moe.linear2_waits_linear1",
    STAGE_COMBINE_DONE: "moe.reduce_waits_combine",
    STAGE_BUFFER_FREE: "moe.combine_buffer_free",
    STAGE_STORE_PACING: "moe.combine_store_pacing",
    STAGE_PLAN_BARRIER: "moe.plan_waits_programs",
}
