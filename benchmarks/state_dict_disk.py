"""Disk use after five epochs of model + optimizer state dicts and checkpoints, per store kind.

    python -m benchmarks.state_dict_disk                   # tables as small (the default)
    python -m benchmarks.state_dict_disk --large           # every table as large (snapshots)
    python -m benchmarks.state_dict_disk --smoke

A ``DiskEmbedding`` (weights, m, v) and an ``nn.Embedding`` (m and v in the optimizer's store)
of ``--rows`` x ``--dim`` float32 under one ``DiskSparseAdam``; each of five epochs of 20
steps (batches of 4,096 ids) ends with ``torch.save({"model": model.state_dict(), "optim":
opt.state_dict()})`` and ``opt.checkpoint(ckpts/ep{e}, extra={"model": model.state_dict()})``.
Then ``du -sc --block-size=1M`` of the run directory (live stores and state-dict snapshots),
the checkpoints, both together (hard links counted once), and the ``.pt`` files. ``--large``
sets ``DiskWeight.read_limit = 0``: every table then keeps snapshots instead of its rows in
the state dict. Writes ``benchmarks/results/state_dict_disk[_large].json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _du(*paths) -> int:
    out = subprocess.run(["du", "-sc", "--block-size=1M", *map(str, paths)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--large", action="store_true", help="every table keeps snapshots")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.dim = 2_000, 8
    import torch

    from adapters.torch import DiskEmbedding, DiskSparseAdam, DiskWeight
    if a.large:
        DiskWeight.read_limit = 0
    N, D = a.rows, a.dim
    out: dict = {"rows": N, "dim": D, "large": a.large, "MiB": {}}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for kind in ("inplace", "log"):
            root = Path(tmp) / kind
            kw = {"storage": "log", "memory": "16MiB"} if kind == "log" else {"storage": kind}
            emb = DiskEmbedding(N, D, state_dir=root / "run" / "emb", seed=0, **kw)
            lin = torch.nn.Embedding(N, D, sparse=True)
            model = torch.nn.ModuleDict({"emb": emb, "lin": lin})
            opt = DiskSparseAdam(model.parameters(), lr=0.01, state_dir=root / "run" / "opt",
                                 **kw)
            g = torch.Generator().manual_seed(0)
            for e in range(5):
                for _ in range(20):
                    x = torch.randint(0, N, (4096,), generator=g)
                    (emb(x).pow(2).sum() + lin(x).pow(2).sum()).backward()
                    opt.step()
                    opt.zero_grad()
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                           root / f"sd{e}.pt")
                opt.checkpoint(root / "ckpts" / f"ep{e}", extra={"model": model.state_dict()})
            opt.close()
            emb.close()
            row = {"run_dir": _du(root / "run"), "checkpoints": _du(root / "ckpts"),
                   "run_and_checkpoints": _du(root / "run", root / "ckpts"),
                   "state_dict_files": _du(*root.glob("sd*.pt"))}
            out["MiB"][kind] = row
            print(kind, ", ".join(f"{k}={v} MiB" for k, v in row.items()), flush=True)
            shutil.rmtree(root)
    if not a.smoke:
        RESULTS.mkdir(exist_ok=True)
        name = "state_dict_disk_large" if a.large else "state_dict_disk"
        (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
