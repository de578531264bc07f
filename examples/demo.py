"""What ``make demo`` runs: SparseAdam's results from DSA, and a table beyond its memory budget.

Two parts, about two minutes on two CPU cores (measured: 1 min 49 s and 1 min 57 s on a shared
2-core machine; examples/README.md):

1. **Parity** (:mod:`examples.kg_embedding`): ComplEx on UMLS (from the data files of
   PyKEEN's wheel; nothing is downloaded), trained with :class:`adapters.torch.DiskSparseAdam`
   (entity and relation tables, and their Adam moments, in dsa_core stores on disk) and, from
   the same initial weights and batches, with ``torch.optim.SparseAdam`` in RAM; then
   ``torch.optim.SparseAdam`` from two more seeds, to show the seed-to-seed spread of the MRR.
   Prints the filtered test MRR and Hits@k of each and the memory each used, and writes both
   loss curves to ``runs/demo/loss.png``. The graph has 135 entities: this part shows that the
   numbers are the same, not what DSA is for.
2. **Out of core** (:mod:`examples.out_of_core`): a 2M x 64 table whose weights, m and v
   (1.4 GiB) are 11.4 times the memory budget its log-structured store is given (128 MiB),
   trained for three epochs with ``DiskSparseAdam`` in a child process, then with
   ``torch.optim.SparseAdam`` on the same batches in another; prints each child's peak RSS
   (and its anonymous and file-backed parts) beside an empty ``import torch`` child's, the
   throughput, and the loss per epoch of both. The store (under ``runs/demo/ooc``) is
   removed at the end unless ``--keep``.

    python -m examples.demo [--smoke] [--keep] [--only parity|ooc] [kg_embedding options]

``--smoke`` runs both parts at tiny sizes (seconds; what the tests run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import _kg, kg_embedding, out_of_core

DEMO = kg_embedding.Config(dataset="umls", model="complex", dim=128, epochs=40, batch=256,
                           neg=32, lr=0.02, reg=3e-3, seed=0, table="disk")
KG_SMOKE = {"--epochs": "1", "--dim": "16", "--noise-seeds": "1"}  # part 1 with --smoke


def _has(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _value(argv: list[str], flag: str) -> str | None:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``)."""
    val = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            val = argv[i + 1]
        elif a.startswith(flag + "="):
            val = a.split("=", 1)[1]
    return val


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m examples.demo", add_help=False)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--only", choices=("parity", "ooc"))
    p.add_argument("-h", "--help", action="store_true")
    a, rest = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if a.help:
        print(__doc__)
        kg_embedding.parse_args(["--help"], DEMO)
    if a.smoke:
        rest = [x for k, v in KG_SMOKE.items() if not _has(rest, k) for x in (k, v)] + rest
        if "--no-progress" not in rest:
            rest.append("--no-progress")
    if not _has(rest, "--out"):
        rest += ["--out", "runs/demo"]
    if not _has(rest, "--noise-seeds"):
        rest += ["--noise-seeds", "2"]
    out = {}
    if a.only != "ooc":
        try:
            _kg.dataset_dir(DEMO.dataset)
        except FileNotFoundError as exc:
            sys.exit(f"make demo: {exc}")
        print("DSA demo, part 1 (parity): ComplEx knowledge-graph embedding of UMLS, trained "
              "with DiskSparseAdam (tables and Adam state on disk)\nand with "
              "torch.optim.SparseAdam in RAM from the same initial weights and batches, then "
              "SparseAdam from 2 more seeds.\n", flush=True)
        out["parity"] = kg_embedding.main(rest, defaults=DEMO)
    if a.only != "parity":
        ooc = ["--smoke"] if a.smoke else []
        if "--no-progress" in rest:
            ooc.append("--no-progress")
        if a.keep:
            ooc.append("--keep")
        work = Path(_value(rest, "--out"))
        print("\nDSA demo, part 2 (out of core): a table whose weights and Adam state are "
              "larger than the memory budget it is given,\ntrained with DiskSparseAdam on a "
              "log-structured store, then with torch.optim.SparseAdam in RAM (each in a child "
              "process).\n", flush=True)
        out["ooc"] = out_of_core.main([*ooc, "--dir", str(work / "ooc")])
    return out


if __name__ == "__main__":
    main()
