"""One rank of the peer-path probe check: launch with release flags, receive, verify."""

import os

import torch


def probe_peer_worker(rank, world, init_file, result_file):
    import torch.distributed as dist

    from xstage.comm import create_context
    from xstage.probe.runner import BurstConfig, dest_elems, launch, receive

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    lines = []
    try:
        small = not torch.cuda.is_available()
        cfgs = [BurstConfig(path="peer", peer_mode=mode, n_sm=3 if small else 8, warps=1 if small else 8,
                            burst_bytes=512 if small else 16384, n_bursts=2, gap_iters=10, completion="flag")
                for mode in ("one", "all")]
        with create_context(path="peer", device=device, timeout_ns=20_000_000_000,
                            signal_slots=world * max(c.n_ctas for c in cfgs)) as ctx:
            dest = ctx.alloc("dst", (max(dest_elems(c, world) for c in cfgs),), torch.int32)
            for cfg in cfgs:
                dest.local.fill_(-1)
                ctx.reset_signals()
                ctx.barrier()
                launch(ctx, dest, cfg)
                got = receive(ctx, dest, cfg)
                ctx.barrier()
                want = sum(1 for s in range(world) if s != rank
                           for i in range(cfg.n_ctas)
                           if (cfg.peer_mode == "one" and (s + 1) % world == rank)
                           or (cfg.peer_mode == "all" and (s + 1 + i % (world - 1)) % world == rank))
                lines.append(f"{cfg.peer_mode} {got['regions']} {want} {len(got['bad'])}")
        with open(f"{result_file}.{rank}", "w") as f:
            f.write("\n".join(lines))
    finally:
        dist.destroy_process_group()


def measure_worker(rank, world, init_file, result_file, out_dir, n_sm):
    """One rank of a sliced `measure` on path peer (interpreter on a CPU, shared GPU otherwise)."""
    import torch.distributed as dist

    from xstage.probe.session import measure

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        info = measure(out_dir, "peer", ["first", "peers"], only=[f"n_sm={n_sm}", "burst_bytes=65536"], repeats=1,
                       progress=False, allow_interpreter=True)
        with open(f"{result_file}.{rank}", "w") as f:
            f.write(f"{info['configs_run']} {info['timing']}")
    finally:
        dist.destroy_process_group()
