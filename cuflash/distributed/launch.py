"""Start one process per GPU with torchrun's environment variables, wait for them, fail fast.

    python -m cuflash.distributed.launch --nproc-per-node 2 train.py --steps 10
    python -m cuflash.distributed.launch --nproc-per-node 2 -m cuflash.distributed.bench --seqlen 262144

Each process gets RANK = LOCAL_RANK (0 .. N-1), WORLD_SIZE = LOCAL_WORLD_SIZE = N, MASTER_ADDR = 127.0.0.1 and a
free MASTER_PORT (cuflash's rendezvous uses MASTER_PORT + 1), with the rest of this environment unchanged. When a
process exits with an error the others are stopped and that exit code is returned. One node only; across nodes use
torchrun or an MPI launcher (see cuflash.distributed._group).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port, and the one above it, free on this host now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535 and _free(port) and _free(port + 1):
            return port
    raise RuntimeError("found no two adjacent free TCP ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuflash.distributed.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, required=True, metavar="N", help="processes (GPUs) to start")
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    p.add_argument("target", help="script path (or module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the target")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.nproc_per_node < 1:
        raise SystemExit(f"--nproc-per-node {args.nproc_per_node}: must be >= 1")
    port = free_port()
    command = [sys.executable] + (["-m"] if args.module else []) + [args.target] + args.args
    procs = {}  # process -> rank
    for rank in range(args.nproc_per_node):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc_per_node),
                   LOCAL_WORLD_SIZE=str(args.nproc_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs[subprocess.Popen(command, env=env)] = rank
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                rank = procs.pop(p)
                if rc != 0 and code == 0:
                    code = rc
                    print(f"cuflash.distributed.launch: rank {rank} exited with {rc}; stopping the others",
                          file=sys.stderr)
                    for other in procs:
                        other.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
