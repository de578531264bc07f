"""What ``make demo`` runs: a knowledge-graph embedding with its optimizer state on disk.

ComplEx on UMLS (from the data files of PyKEEN's wheel; nothing is downloaded), trained with
:class:`adapters.torch.DiskSparseAdam` (entity and relation tables, and their Adam moments,
in dsa_core stores on disk) and, from the same initial weights and batches, with
``torch.optim.SparseAdam`` in RAM; then ``torch.optim.SparseAdam`` from two more seeds, to
show the seed-to-seed spread of the MRR. Prints the filtered test MRR and Hits@k of each,
the memory each used, and writes both loss curves to ``runs/demo/loss.png``. About a
minute on two CPU cores (measured: 64 s).

    python -m examples.demo [kg_embedding options, e.g. --epochs 10]
"""

from __future__ import annotations

import sys

from . import _kg, kg_embedding

DEMO = kg_embedding.Config(dataset="umls", model="complex", dim=128, epochs=40, batch=256,
                           neg=32, lr=0.02, reg=3e-3, seed=0, table="disk")


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("--out") for a in argv):
        argv += ["--out", "runs/demo"]
    if not any(a.startswith("--noise-seeds") for a in argv):
        argv += ["--noise-seeds", "2"]
    try:
        _kg.dataset_dir(DEMO.dataset)
    except FileNotFoundError as exc:
        sys.exit(f"make demo: {exc}")
    print("DSA demo: ComplEx knowledge-graph embedding of UMLS, trained with DiskSparseAdam "
          "(tables and Adam state on disk)\nand with torch.optim.SparseAdam in RAM from the same "
          "initial weights and batches, then SparseAdam from 2 more seeds.\n")
    return kg_embedding.main(argv, defaults=DEMO)


if __name__ == "__main__":
    main()
