"""PyKEEN: DiskAdam through PyKEEN's own pipeline() against torch.optim.SparseAdam.

    python -m benchmarks.pykeen_parity                 # 4 models x sLCWA/LCWA on Nations
    python -m benchmarks.pykeen_parity --dataset Kinships --epochs 20
    python -m benchmarks.pykeen_parity --smoke         # seconds; CI runs this

For each model and training loop, the same seeded ``pipeline()`` runs with:

- ``sparseadam``: ``adapters.pykeen.SparseEmbedding`` tables (PyKEEN's Embedding with
  row-sparse gradients, weights in RAM) and ``torch.optim.SparseAdam`` -- the reference;
- ``ram``: the same tables, ``adapters.pykeen.DiskAdam`` (m and v on disk);
- ``inplace`` / ``log``: ``adapters.pykeen.DiskBackedEmbedding`` tables (weights, m and v
  in one store of that kind), ``DiskAdam``.

It prints and writes (``benchmarks/results/pykeen_parity.{json,csv}``) the largest absolute
difference of any weight to the reference, and each run's MRR and Hits@10 (both-sided,
realistic, filtered; evaluation in slices of ``--slice`` entities) beside the reference's.
Nothing is timed: this is a correctness table. Datasets: those that ship inside PyKEEN
(Nations, Kinships, UMLS).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from ._common import machine, print_table, write_results

MODELS = ("TransE", "DistMult", "ComplEx", "RotatE")
LOOPS = ("sLCWA", "LCWA")


def _tables(model):
    import torch

    out = []
    for rep in (*model.entity_representations, *model.relation_representations):
        with torch.no_grad():
            x = rep._plain_forward(torch.arange(rep.max_id))
        out.append(torch.view_as_real(x) if x.is_complex() else x.clone())
    return out


def run_one(tmp: Path, args, model: str, loop: str, impl: str):
    import torch
    from pykeen.pipeline import pipeline

    from adapters import pykeen as dsa

    if impl == "sparseadam":
        reps, opt, okw = dsa.sparse_representations(), torch.optim.SparseAdam, {}
    elif impl == "ram":
        reps, opt, okw = dsa.sparse_representations(), dsa.DiskAdam, {"state_dir": tmp / "opt"}
    else:
        reps = dsa.disk_representations(tmp / "tables", storage=impl)
        opt, okw = dsa.DiskAdam, {}
    r = pipeline(dataset=args.dataset, model=model, training_loop=loop, random_seed=args.seed,
                 model_kwargs=dict(embedding_dim=args.dim, **reps), optimizer=opt,
                 optimizer_kwargs=dict(lr=args.lr, **okw),
                 training_kwargs=dict(num_epochs=args.epochs, batch_size=args.batch,
                                      use_tqdm=False, pin_memory=False),
                 evaluation_kwargs=dict(slice_size=args.slice, use_tqdm=False))
    out = _tables(r.model), r.get_metric("mrr"), r.get_metric("hits@10")
    dsa.close(r.model, r.training_loop.optimizer)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="Nations")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--loops", nargs="+", default=list(LOOPS))
    p.add_argument("--impls", nargs="+", default=["ram", "inplace", "log"])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--slice", type=int, default=16, help="evaluation slice (entities)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="TransE, sLCWA, 1 epoch, dim 8")
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.loops, args.epochs, args.dim = ["TransE"], ["sLCWA"], 1, 8
    for name in ("pykeen", "torch_max_mem"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for model in args.models:
            for loop in args.loops:
                base = run_one(Path(tmp) / f"{model}_{loop}_ref", args, model, loop,
                               "sparseadam")
                for impl in args.impls:
                    w, mrr, h10 = run_one(Path(tmp) / f"{model}_{loop}_{impl}", args, model,
                                          loop, impl)
                    diff = max(float((a - b).abs().max()) for a, b in zip(w, base[0]))
                    rows.append({"dataset": args.dataset, "model": model, "loop": loop,
                                 "impl": impl, "max_abs_dw": diff, "mrr": mrr,
                                 "mrr_sparseadam": base[1], "hits10": h10,
                                 "hits10_sparseadam": base[2]})
    print_table(rows, ["model", "loop", "impl", "max_abs_dw", "mrr", "mrr_sparseadam",
                       "hits10", "hits10_sparseadam"])
    meta = {"machine": machine(), "args": {k: v for k, v in vars(args).items()
                                           if k != "workdir"}}
    write_results("pykeen_parity_smoke" if args.smoke else "pykeen_parity", rows, meta)


if __name__ == "__main__":
    main()
