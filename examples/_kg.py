"""Knowledge-graph data and filtered link-prediction evaluation, shared by the KG examples.

The datasets are the small benchmark graphs that PyKEEN's wheel ships as plain text files
(``pykeen/datasets/{umls,kinships,nations}/{train,valid,test}.txt``, one tab-separated
``head  relation  tail`` triple a line). PyKEEN itself is never imported: only its data files
are read, so ``pip install --no-deps pykeen==1.11.1`` is all that is needed, and nothing is
downloaded at run time.

Triples are trained and evaluated with reciprocal relations (Lacroix et al. 2018): the query
``(h, r, ?)`` predicts tails, and ``(t, r + R, ?)`` predicts heads through the inverse
relation ``r + R``. Ranks are *filtered* (Bordes et al. 2013): the other known answers of a
query (from train, valid and test) are removed before the true answer is ranked, and ties
count half ("realistic" rank).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["DATASETS", "KG", "batches", "dataset_dir", "evaluate", "load", "random_baseline",
           "reciprocal"]

DATASETS = ("umls", "kinships", "nations")
PYKEEN_PIN = "pykeen==1.11.1"


class KG(NamedTuple):
    """A knowledge graph with integer ids; triples are int64 arrays ``(n, 3)`` of (h, r, t)."""

    name: str
    entities: list[str]
    relations: list[str]
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray

    @property
    def num_entities(self) -> int:
        return len(self.entities)

    @property
    def num_relations(self) -> int:
        """Relations of the data; the models use ``2 * num_relations`` (reciprocals)."""
        return len(self.relations)


def dataset_dir(name: str) -> Path:
    """The directory of a dataset inside the installed PyKEEN wheel (which is not imported)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")
    spec = importlib.util.find_spec("pykeen")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {name!r} dataset ships inside the PyKEEN wheel, which is not installed; "
            f"install its data files with `pip install --no-deps {PYKEEN_PIN}` (make demo "
            "does this)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / name
    if not (path / "train.txt").is_file():
        raise FileNotFoundError(f"{path / 'train.txt'} not found: this PyKEEN does not ship "
                                f"the {name!r} files; install {PYKEEN_PIN}")
    return path


def _read(path: Path) -> list[tuple[str, str, str]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 3:
                out.append((parts[0], parts[1], parts[2]))
    return out


def load(name: str = "umls") -> KG:
    """Read a dataset's train/valid/test triples and give entities and relations ids.

    Ids are the positions in the sorted names, so they do not depend on file order.
    """
    d = dataset_dir(name)
    splits = {s: _read(d / f"{s}.txt") for s in ("train", "valid", "test")}
    ents = sorted({x for tr in splits.values() for h, _, t in tr for x in (h, t)})
    rels = sorted({r for tr in splits.values() for _, r, _ in tr})
    e_id = {e: i for i, e in enumerate(ents)}
    r_id = {r: i for i, r in enumerate(rels)}

    def ids(tr):
        return np.array([(e_id[h], r_id[r], e_id[t]) for h, r, t in tr],
                        dtype=np.int64).reshape(-1, 3)

    return KG(name, ents, rels, ids(splits["train"]), ids(splits["valid"]),
              ids(splits["test"]))


def reciprocal(triples: np.ndarray, num_relations: int) -> np.ndarray:
    """``(h, r, t)`` -> queries ``(h, r, t)`` and ``(t, r + R, h)``, stacked: ``(2n, 3)``."""
    h, r, t = triples.T
    inv = np.stack([t, r + num_relations, h], axis=1)
    return np.concatenate([triples, inv])


def batches(queries: np.ndarray, num_entities: int, batch: int, neg: int,
            rng: np.random.Generator):
    """One epoch of training batches: ``(queries (B, 3), negatives (B, neg))`` int64 arrays.

    The queries are shuffled; each gets ``neg`` entities drawn uniformly (they may hit the
    true answer: mask those). The draws come from ``rng`` in a fixed order, so two runs with
    equally seeded generators see identical batches, whatever framework trains on them.
    """
    perm = rng.permutation(len(queries))
    for lo in range(0, len(queries), batch):
        qb = queries[perm[lo:lo + batch]]
        yield qb, rng.integers(0, num_entities, (len(qb), neg))


def _known_answers(kg: KG) -> dict[tuple[int, int], np.ndarray]:
    """(query entity, query relation incl. reciprocals) -> all known answers (filter set)."""
    q = reciprocal(np.concatenate([kg.train, kg.valid, kg.test]), kg.num_relations)
    q = np.unique(q, axis=0)
    keys = q[:, 0] * (2 * kg.num_relations) + q[:, 1]
    order = np.argsort(keys, kind="stable")
    keys, ans = keys[order], q[order, 2]
    cut = np.flatnonzero(np.diff(keys)) + 1
    out = {}
    for k, a in zip(np.split(keys, cut), np.split(ans, cut)):
        out[divmod(int(k[0]), 2 * kg.num_relations)] = a
    return out


def evaluate(score_fn: Callable[[np.ndarray, np.ndarray], np.ndarray], kg: KG,
             split: str = "test", batch: int = 512) -> dict[str, float]:
    """Filtered MRR, Hits@{1,3,10} and mean rank of head and tail prediction on a split.

    ``score_fn(ents, rels)`` gets the query entities and (reciprocal) relations of a batch
    and returns the scores of every entity as an answer, ``(B, num_entities)``, higher is
    better.
    """
    known = _known_answers(kg)
    q = reciprocal(getattr(kg, split), kg.num_relations)
    ranks = np.empty(len(q))
    for lo in range(0, len(q), batch):
        qb = q[lo:lo + batch]
        s = np.array(score_fn(qb[:, 0], qb[:, 1]), dtype=np.float64, copy=True)
        true = s[np.arange(len(qb)), qb[:, 2]].copy()
        for i, (e, r, t) in enumerate(qb):
            s[i, known[(int(e), int(r))]] = -np.inf   # filter every known answer...
            s[i, t] = true[i]                         # ...except the one being ranked
        higher = (s > true[:, None]).sum(1)
        ties = (s == true[:, None]).sum(1) - 1
        ranks[lo:lo + len(qb)] = 1 + higher + ties / 2
    return {"mrr": float(np.mean(1.0 / ranks)), "hits@1": float(np.mean(ranks <= 1)),
            "hits@3": float(np.mean(ranks <= 3)), "hits@10": float(np.mean(ranks <= 10)),
            "mean_rank": float(np.mean(ranks))}


def random_baseline(kg: KG, split: str = "test") -> dict[str, float]:
    """Expected filtered MRR and Hits@10 of uniformly random scores, computed exactly.

    After filtering, a query has ``n`` candidates (the true answer and every entity that is
    not a known answer); under random scores its rank is uniform on ``1..n``, so the
    expected reciprocal rank is ``H(n) / n`` and ``P(rank <= 10) = min(10, n) / n``.
    """
    known = _known_answers(kg)
    q = reciprocal(getattr(kg, split), kg.num_relations)
    n = np.array([kg.num_entities - len(known[(int(e), int(r))]) + 1 for e, r, _ in q])
    harmonic = np.cumsum(1.0 / np.arange(1, kg.num_entities + 1))
    return {"mrr": float(np.mean(harmonic[n - 1] / n)),
            "hits@10": float(np.mean(np.minimum(10, n) / n))}
