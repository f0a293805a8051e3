"""Launch helpers shared by the multi-process gloo tests."""

import socket


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_spawned(worker, world: int, *args) -> int:
    """Start ``worker(rank, world, *args)`` in ``world`` spawned processes; stop all of them as
    soon as one fails. Returns the largest exit code (0 when every rank passed)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank, world, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    running = list(procs)
    while running:
        wait([p.sentinel for p in running])
        running = [p for p in running if p.is_alive()]
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in running:
                p.terminate()
            for p in procs:
                p.join()
            break
    return max(abs(p.exitcode) for p in procs)


def finish_rank() -> None:
    """End a worker: barrier, tear the process group down, and leave without interpreter
    teardown (gloo's worker threads, joined while Python finalizes, occasionally abort the
    process with "terminate called without an active exception")."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
