"""Ring attention on two or more GPUs, one process each (python -m cuflash.distributed.launch), dense and packed
(varlen) batches: every rank's outputs and gradients against the unsharded float64 problem by the pass rule, and bit for bit against the
one-process simulation of the same ring (tests/multigpu_ring_worker.py does the work)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multigpu

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multigpu_ring_worker.py")


def gpu_count() -> int:
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


def test_ring_attention_across_gpus(tmp_path):
    world = gpu_count()
    run = subprocess.run([sys.executable, "-m", "cuflash.distributed.launch", "--nproc-per-node", str(world), WORKER,
                          str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"launcher exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    records = []
    for r in range(world):
        with open(tmp_path / f"rank{r}.json") as f:
            records += json.load(f)
    errors = [rec["error"] for rec in records if "error" in rec]
    assert not errors, errors[0]
    assert len(records) == 5 * world  # three dense cases, a packed (varlen) one, the bad inputs
    for rec in [rec for rec in records if rec["case"] == "bad input"]:
        rank = rec["rank"]
        if rank == 1:  # its own validation errors
            assert rec["dtype"].startswith("TypeError") and "dtype" in rec["dtype"], rec
        else:
            assert rec["dtype"].startswith("ValueError") and "rank 1 of" in rec["dtype"] and "rejected" in \
                rec["dtype"], rec
        assert rec["length"].startswith("ValueError") and "shards differ" in rec["length"], rec
    for rec in [rec for rec in records if rec["case"] != "bad input"]:
        what = f"{rec['case']} rank {rec['rank']}"
        for name in ("o", "dq", "dk", "dv", "dq_det", "dk_det", "dv_det"):
            res = rec[name]
            assert res["finite"], f"{name} has NaN/inf for {what}"
            assert res["err"] <= res["bound"], f"{name} mismatch for {what}: {res['err']:.3e} > {res['bound']:.3e}"
        assert rec["lse_err"] <= 1e-3, f"lse mismatch for {what}: {rec['lse_err']:.3e}"
        for name in ("o_bitwise_sim", "lse_bitwise_sim", "dq_det_bitwise_sim", "dk_det_bitwise_sim",
                     "dv_det_bitwise_sim"):
            assert rec[name], f"{name.replace('_bitwise_sim', '')} of the GPUs' ring differs from the one-process " \
                              f"simulation for {what}"
