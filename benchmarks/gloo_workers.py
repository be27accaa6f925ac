"""torch's gloo groups (two worker threads) against torchpar's (one), two ranks on this machine:
a functional all-gather (what DTensor's redistributions run) and an all-reduce in flight together
on one group, then both waited, over and over for ``--seconds``. Prints each kind's iterations per
second and how each run ended.

Why torchpar gives every gloo group one worker: in torch 2.13 a worker writes the finished
collective's name into the group's status string outside the group's lock, so two workers finishing
together free the name's buffer twice when the name is too long for the string's inline buffer (the
functional all-gather's is): a rank aborts in malloc ("double free or corruption",
"malloc(): unaligned tcache chunk detected"). Rare: on this machine, with a busy core beside it,
torch's kind aborted after ~100 s and ~140 s in two runs and ran 300 s clean in a third; a clean
run of torch's kind proves nothing. The figure that matters for the suite is the cost of one
worker: the iterations per second of the two kinds.

    python benchmarks/gloo_workers.py [--seconds 60] [--kinds torch,torchpar]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchpar.selftest import free_port


def _rank(rank: int, kind: str, seconds: float, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if kind == "torchpar":
        from torchpar.device import use_one_worker_gloo

        use_one_worker_gloo()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    name = dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    x, done, iterations = torch.ones(8), torch.zeros(1), 0
    start = time.perf_counter()
    while True:
        if iterations % 500 == 0:  # (both ranks stop at the same iteration)
            done.fill_(float(time.perf_counter() - start > seconds))
            dist.all_reduce(done)
            if done.item():
                break
        gathered = ops.all_gather_into_tensor(x, 2, name)
        summed = ops.all_reduce(x.clone(), "sum", name)
        ops.wait_tensor(gathered)
        ops.wait_tensor(summed)
        iterations += 1
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{iterations} {time.perf_counter() - start}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kinds", default="torch,torchpar")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, 2 ranks, a functional all-gather and an all-reduce in flight, "
          f"{args.seconds:.0f} s each")
    for kind in args.kinds.split(","):
        out = f"/tmp/gloo_workers_{os.getpid()}_{kind}"
        context = mp.start_processes(_rank, args=(kind, args.seconds, free_port(), out), nprocs=2,
                                     start_method="spawn", join=False)
        try:
            while not context.join():
                pass
        except mp.ProcessException:  # (a rank died: join stopped the other)
            pass
        ended = [p.exitcode for p in context.processes]
        if all(code == 0 for code in ended) and os.path.exists(out):
            iterations, seconds = open(out).read().split()
            os.remove(out)
            print(f"{kind:9s} ({'one worker' if kind == 'torchpar' else 'two workers'}): "
                  f"{int(iterations) / float(seconds):8.0f} iterations/s, both ranks exited 0")
        else:
            print(f"{kind:9s}: ranks' exit codes {ended} (a negative code is the signal that ended it)")


if __name__ == "__main__":
    main()
