"""Command line: ``python -m dsa_core`` or ``dsa``.

    dsa info    PATH              a store: shape, dtype, curvature, count, hyperparameters, size,
                                  format, whether a writer holds it; a log store's segments,
                                  live and dead bytes; a directory of stores (an optimizer's
                                  state_dir, a checkpoint): one line per store
    dsa export  STORE OUT.npy     the weights as a .npy file, written in chunks
    dsa verify  STORE             header, an unclean stop (a writer that ended between a step
                                  and the next flush), finite values, rows inside the ball
                                  (c > 0); a log store's checksums and its index against its
                                  segments
    dsa convert SRC DEST --storage log|inplace [--memory 4GiB] [--overwrite]
                                  copy a store into a new one of the other kind
    dsa bench   [--rows N]        a quick warm benchmark of this machine
    dsa --version                 the package version (and the store format it writes)

``info``, ``export``, ``verify`` and ``convert`` open the store read-only (no lock), so they
can run while a training process writes to it. The count they show is the one in
``manifest.json``: with ``durability="flush"`` (the default) that is the count at the writer's
last flush. Every command works on both kinds of store (in-place and ``storage="log"``).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHUNK_BYTES = 1 << 26

# On-disk names (the store format, see docs/storage.md). The CLI reads them directly rather
# than through the core's private modules, so it does not depend on how those are split.
FORMAT_NAME = "dsa-store"
LOG_FORMAT_NAME = "dsa-log"          # a log-structured store (storage="log")
MANIFEST_FILE = "manifest.json"
DATA_FILE = "rows.dsa"
WRITER_LOCK = "writer.lock"          # the writer holds LOCK_EX on it while the store is open
# Files the adapters leave next to their stores; only used to say what a directory is.
DIR_MARKERS = {
    ".dsa-torch.lock": "the state_dir of a torch DiskSparseAdam",
    "optimizer.pt": "a DiskSparseAdam checkpoint (opt.checkpoint)",
    "checkpoint.json": "a JAX optimizer checkpoint (adapters.jax.checkpoint)",
}
SHARD_FILE = "shard.json"            # rank{k}/shard.json: a ShardedDiskEmbedding shard
SCAN_DEPTH = 2                       # how deep `dsa info DIR` looks for stores (hidden
                                     # directories, e.g. the adapters' .dsa-snapshots, skipped)


# -- argument types ---------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``1_000_000`` allowed)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def memory_size(text: str) -> int:
    """argparse type: a memory budget, ``4GiB``, ``512MiB``, ``1.5G`` or bytes."""
    from ._validation import check_memory_arg

    try:
        return check_memory_arg(text, "log")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def existing_dir(text: str) -> str:
    """argparse type: a directory that exists."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory")
    return text


# -- looking at a path without opening it -----------------------------------------------------
def lock_held(path: Path) -> bool | None:
    """Whether another open file holds an exclusive ``flock`` on ``path``.

    A non-blocking shared lock is tried and, if granted, released at once: the writer keeps
    its exclusive lock untouched. ``False`` when the file does not exist (nobody ever held
    it, or the store was never opened for writing); ``None`` when it cannot be told.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _manifest(directory: Path) -> dict | None:
    """The store manifest in ``directory``, or None if there is none / it is not a store's."""
    try:
        m = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return m if isinstance(m, dict) and m.get("format") in (FORMAT_NAME, LOG_FORMAT_NAME) \
        else None


def _damage(directory: Path) -> str | None:
    """What is wrong with a directory that holds store files but no manifest, else None.

    The text completes "PATH is ...".
    """
    if (directory / MANIFEST_FILE).exists():
        return None
    if (directory / DATA_FILE).exists():
        return (f"a damaged DSA store: its data file {DATA_FILE} is present but "
                f"{MANIFEST_FILE} is missing (it holds the shape, layout, hyperparameters and "
                "count, so the rows cannot be read). Restore the store from a checkpoint, or "
                "delete the directory and create it again")
    if (directory / (DATA_FILE + ".tmp")).exists():
        return (f"not a DSA store: it holds only {DATA_FILE}.tmp, left by a dsa_core.create "
                "that was interrupted (or is running now). Delete the directory and create "
                "the store again")
    from ._engines import orphaned_files

    files = orphaned_files(directory)
    if files:
        more = f" and {len(files) - 1} more" if len(files) > 1 else ""
        return (f"a damaged DSA store: it holds a store's files ({files[0]}{more}) but its "
                f"{MANIFEST_FILE} is missing (it says which of them hold the rows, and the "
                "count), so they cannot be read. Restore the store from a checkpoint")
    return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _find_stores(root: Path, depth: int = SCAN_DEPTH) -> list[tuple[Path, str | None]]:
    """Stores in the subdirectories of ``root``, up to ``depth`` levels down, sorted.

    Each entry is ``(path, None)`` for a store and ``(path, message)`` for a damaged one. A
    store's own subdirectories are not searched.
    """
    found: list[tuple[Path, str | None]] = []
    if depth < 1:
        return found
    try:
        children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return found
    for child in children:
        if _manifest(child) is not None:
            found.append((child, None))
        elif (bad := _damage(child)) is not None:
            found.append((child, bad))
        else:
            found.extend(_find_stores(child, depth - 1))
    return found


def _not_a_store(path) -> None:
    """Raise a clear SystemExit for a path that is not a store but tells us something."""
    directory = Path(path)
    if not directory.is_dir() or (directory / MANIFEST_FILE).exists():
        return
    if (bad := _damage(directory)) is not None:
        raise SystemExit(f"dsa: {str(directory)!r} is {bad}")
    stores = _find_stores(directory)
    if stores:
        names = ", ".join(str(p.relative_to(directory)) for p, _ in stores[:8])
        more = f" and {len(stores) - 8} more" if len(stores) > 8 else ""
        raise SystemExit(
            f"dsa: {str(directory)!r} is not a DSA store itself but holds "
            f"{_plural(len(stores), 'store')}: {names}{more}. Pass one of them "
            f"(`dsa info {path}` lists them)")


def _open(path, unclean: str = "refuse", unclean_hint: str = ""):
    import dsa_core

    _not_a_store(path)
    try:
        return dsa_core.open(path, mode="r", unclean=unclean)
    except dsa_core.UncleanStopError as exc:
        raise SystemExit(f"dsa: {exc}{unclean_hint}") from None
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"dsa: {exc}") from None


def _unclean(st) -> bool:
    """Was the store stopped uncleanly (opened read-only with ``unclean="accept"``)?"""
    return bool(st.store.stats().get("unclean_stop", False))


UNCLEAN_NOTE = ("its writer stopped after a step and before the next flush or close, and its "
                "rows cannot be put back at the last flush (the machine restarted since, so "
                "its undo record is not trusted, or it has none): rows may hold steps past "
                "the count; dsa_core.open refuses it until it is restored from a checkpoint "
                "(dsa_core.restore) or opened with unclean='accept'")


def _chunks(n, row_bytes):
    rows = max(1, CHUNK_BYTES // max(1, row_bytes))
    for lo in range(0, n, rows):
        yield lo, min(n, lo + rows)


def _bar(total, desc, enabled=True):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="row", unit_scale=True, disable=not enabled)


# -- info ------------------------------------------------------------------------------------
def _geometry(st) -> str:
    if st.optimizer == "adagrad":
        return "euclidean (Adagrad)"
    if st.optimizer == "rowwise_adagrad":
        return "euclidean (row-wise Adagrad)"
    if st.curvature > 0:
        return "poincare ball"
    return ("euclidean (SparseAdam)" if st.second_moment == "elementwise"
            else "euclidean (row-wise second moment)")


def _count_as_of(durability: str) -> str:
    return ("the last step (durability='step' commits every step)" if durability == "step"
            else "the last flush")


def _writer_note(st, writer: bool | None) -> str:
    if writer is None:
        return f"unknown (could not probe {WRITER_LOCK})"
    if not writer:
        return "none (no process has the store open for writing)"
    if st.durability == "step":
        return "a writer holds this store (durability='step': the count above is current)"
    return ("a writer holds this store: steps since its last flush are not counted here "
            "(dsa_core.flush or checkpoint updates the count)")


def _info(st) -> dict:
    path = Path(st.path)
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    manifest = _manifest(path) or {}
    return {
        "path": str(st.path), "num_rows": st.num_rows, "dim": st.dim, "dtype": st.dtype.name,
        "curvature": st.curvature, "geometry": _geometry(st), "optimizer": st.optimizer,
        "second_moment": st.second_moment, "first_moment": st.first_moment,
        "weights": st.has_weights, "count": st.count,
        "count_as_of": _count_as_of(st.durability),
        "writer_active": lock_held(path / WRITER_LOCK),
        "unclean_stop": _unclean(st),
        "unclean_stop_note": UNCLEAN_NOTE if _unclean(st) else "no",
        "lr": st.lr, "betas": None if st.betas is None else list(st.betas),
        **({"lr_decay": st.lr_decay,
            "initial_accumulator_value": st.initial_accumulator_value}
           if st.optimizer != "adam" else {}),
        "eps": st.eps, "maximize": st.maximize, "ball_eps": st.ball_eps,
        "nonfinite": st.nonfinite, "durability": st.durability,
        **{k: getattr(st, k) for k in ("weight_decay", "decoupled_weight_decay", "per_row_step",
                                       "decay_missed_steps")},
        "record_bytes": st.store.layout.stride * st.dtype.itemsize,
        "size_on_disk_bytes": size, "format_version": manifest.get("version"),
        "storage": st.storage,
        **st.store.stats(),  # the engine's own figures (dsa_core._engine)
    }


def _summary(st, info: dict) -> str:
    """One line for a store in a directory listing."""
    s = (f"{st.num_rows:,} x {st.dim} {st.dtype.name}, {info['geometry']}, "
         f"count {st.count} (at {_count_as_of(st.durability)})")
    if info["writer_active"]:
        s += ", a writer holds it now"
    if info["unclean_stop"]:
        s += ", UNCLEAN STOP (rows may be past the count: restore or accept it)"
    if not st.has_weights:
        s += ", moments only"
    if info.get("summary"):
        s += f", {info['summary']}"
    return s


def _dir_kinds(directory: Path) -> list[str]:
    """What the adapter files in ``directory`` say it is (best effort, by file name)."""
    kinds = [what for name, what in DIR_MARKERS.items() if (directory / name).exists()]
    if any((p / SHARD_FILE).is_file() for p in directory.glob("rank*")):
        kinds.append("the shards of a ShardedDiskEmbedding (rank*/shard.json)")
    return kinds


def _info_dir(a, directory: Path, stores) -> int:
    import dsa_core

    kinds = _dir_kinds(directory)
    owner = lock_held(directory / ".dsa-torch.lock")
    listing = []
    for p, bad in stores:
        name = str(p.relative_to(directory))
        if bad is None:
            try:
                st = dsa_core.open(p, mode="r", unclean="accept")
            except (OSError, ValueError) as exc:
                bad = f"cannot be opened: {exc}"
            else:
                info = _info(st)
                listing.append({"name": name, "summary": _summary(st, info), **info})
                continue
        listing.append({"name": name, "path": str(p), "error": bad})
    if a.json:
        print(json.dumps({"path": str(directory), "kind": kinds, "optimizer_active": owner,
                          "stores": listing}, indent=1))
        return 0
    n_ok = sum("error" not in e for e in listing)
    head = f"{directory}: not a DSA store itself; it holds {_plural(n_ok, 'store')}"
    if len(listing) > n_ok:
        head += f" and {_plural(len(listing) - n_ok, 'damaged one')}"
    print(head + (f" ({'; '.join(kinds)})" if kinds else "") + ":")
    if owner:
        print("  a DiskSparseAdam holds this state_dir now: steps since its last flush are "
              "not counted here")
    width = max(len(e["name"]) for e in listing) + 1
    for e in listing:
        text = e.get("summary") or f"PROBLEM: {e['error']}"
        print(f"  {e['name'] + '/':<{width}}  {text}")
    print(f"(`dsa info {directory / listing[0]['name']}` shows one in full)")
    return 0


def cmd_info(a) -> int:
    directory = Path(a.store)
    if directory.is_dir() and not (directory / MANIFEST_FILE).exists():
        if (bad := _damage(directory)) is not None:
            raise SystemExit(f"dsa: {str(directory)!r} is {bad}")
        stores = _find_stores(directory)
        if stores:
            return _info_dir(a, directory, stores)
    st = _open(a.store, unclean="accept")
    info = _info(st)
    if a.json:
        print(json.dumps(info, indent=1))
        return 0
    width = max(len(k) for k in info if not k.endswith("_note"))
    for k, v in info.items():
        if k == "count_as_of" or k.endswith("_note"):
            continue
        if k.endswith("_bytes"):
            v = f"{v:,}" + (f" ({_human(v)})" if v >= 1024 else "")
        elif k == "count":
            v = f"{v} (at {info['count_as_of']})"
        elif k == "writer_active":
            k, v = "writer", _writer_note(st, v)
        elif k == "unclean_stop":
            v = f"YES -- {UNCLEAN_NOTE}" if v else "no"
            print(f"{k:>{width}}: {v}")
            continue
        elif k == "storage":
            v = f"{v} ({st.store.info.description})"
        elif k == "summary":
            continue
        if v is None:
            v = "n/a"
        note = info.get(k + "_note") or info.get(k.removesuffix("_bytes") + "_note")
        print(f"{k:>{width}}: {v}" + (f" -- {note}" if note else ""))
    return 0


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def cmd_export(a) -> int:
    import dsa_core

    st = _open(a.store, unclean=a.unclean, unclean_hint=(
        ". To export its rows as they are, pass --unclean accept"))
    if _unclean(st):
        print(f"dsa: warning: {a.store!r} was stopped uncleanly ({UNCLEAN_NOTE}); exporting "
              "its rows as they are (--unclean accept)", file=sys.stderr)
    if not st.has_weights:
        raise SystemExit(f"dsa: store {a.store!r} holds no weights (created with weights=False)")
    out = Path(a.out)
    if out.exists() and not a.force:
        raise SystemExit(f"dsa: {str(out)!r} exists; pass --force to overwrite it")
    if not st.store.info.reads_last_flush and lock_held(Path(st.path) / WRITER_LOCK):
        print("note: a writer holds this store; rows it changed since its last flush may "
              "already be in the export", file=sys.stderr)
    # written beside OUT and renamed when complete: an interrupted export leaves no .npy
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        dst = np.lib.format.open_memmap(tmp, mode="w+", dtype=st.dtype,
                                        shape=(st.num_rows, st.dim))
        # public chunked reads: the same bytes from an in-place store and a log store
        with _bar(st.num_rows, "export", not a.quiet) as bar:
            for lo, hi in _chunks(st.num_rows, st.store.layout.stride * st.dtype.itemsize):
                dsa_core.gather(st, np.arange(lo, hi, dtype=np.int64), out=dst[lo:hi])
                bar.update(hi - lo)
        dst.flush()
        del dst
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out} ({st.num_rows} x {st.dim} {st.dtype.name}, "
          f"count {st.count} at {_count_as_of(st.durability)})")
    return 0


def cmd_verify(a) -> int:
    import dsa_core

    from ._engines import ENGINES, kind_of

    _not_a_store(a.store)
    try:
        kind = kind_of(Path(a.store))
    except OSError as exc:
        raise SystemExit(f"dsa: {exc}") from None
    # every file on its own first (manifest, index, segments and every record, commit log,
    # header): a damaged store is described file by file instead of failing to open
    files = ENGINES[kind or "inplace"].check_files(Path(a.store))
    if len(files) == 1 and files[0][1] is not None and not Path(a.store, files[0][0]).exists():
        raise SystemExit(f"dsa: {files[0][1]}")  # not a store (or not one any more)
    if any(p is not None for _, p, _ in files):
        print(f"{a.store}: {(_manifest(Path(a.store)) or {}).get('format', 'store')}")
        for name, p, what in files:
            print(f"  PROBLEM: the store does not check out: {name}: {p}" if p is not None
                  else f"  file {name}: ok ({what})")
        return 1
    try:  # an unclean stop is reported below, after the checks of its rows
        st = dsa_core.open(a.store, mode="r", unclean="accept")
        problems = st.store.verify()  # the engine's own checks of its files
    except FileNotFoundError as exc:  # not a store (or not one any more)
        raise SystemExit(f"dsa: {exc}") from None
    except (OSError, ValueError) as exc:  # a store whose files do not check out
        print(f"{a.store}: {(_manifest(Path(a.store)) or {}).get('format', 'store')}")
        print(f"  PROBLEM: the store does not check out: {exc}")
        return 1
    bad_rows = 0
    outside = 0
    c = st.curvature
    def read(lo, hi):  # public chunked reads: the same records from either kind
        return dsa_core.read_records(st, np.arange(lo, hi))
    with _bar(st.num_rows, "verify", not a.quiet) as bar:
        for lo, hi in _chunks(st.num_rows, st.store.layout.stride * st.dtype.itemsize):
            blk = np.asarray(read(lo, hi))
            fin = np.isfinite(blk).all(axis=1)
            bad_rows += int((~fin).sum())
            if c > 0 and st.has_weights:
                o = st.store.layout.w_off
                w = blk[:, o:o + st.dim].astype(np.float64)
                sq = np.einsum("ij,ij->i", w, w)
                outside += int((sq * c >= 1.0).sum())
            bar.update(hi - lo)
    if bad_rows:
        problems.append(f"{bad_rows} rows hold NaN or Inf (weights or optimizer state)")
    if outside:
        problems.append(f"{outside} rows lie on or outside the Poincaré ball "
                        f"(norm >= 1/sqrt(c) = {1 / math.sqrt(c):.6g})")
    if _unclean(st):
        problems.append(f"unclean stop: the manifest says count {st.count}, but {UNCLEAN_NOTE}")
    version = (_manifest(Path(st.path)) or {}).get("version")
    print(f"{st.path}: {st.storage} store, format v{version}, {st.store.info.checks}, "
          f"count {st.count}")
    for name, _, what in files:
        print(f"  file {name}: ok ({what})")
    if lock_held(Path(st.path) / WRITER_LOCK):
        print("  note: a writer holds this store; " + (
            "this checked the files of its last flush" if st.store.info.reads_last_flush
            else "rows it is changing now may read half-done"))
    for p in problems:
        print(f"  PROBLEM: {p}")
    if not problems:
        print("  ok: all values finite" + (", all rows inside the ball" if c > 0 else ""))
    return 1 if problems else 0


def cmd_convert(a) -> int:
    import dsa_core

    if a.memory is not None and a.storage != "log":
        raise SystemExit("dsa: --memory is the region budget of a log store; it goes with "
                         "--storage log (an in-place store takes none)")
    src_path, dest = Path(a.src), Path(a.dest)
    st = _open(a.src)
    if dest.resolve() == src_path.resolve() or src_path.resolve() in dest.resolve().parents:
        raise SystemExit(f"dsa: DEST {a.dest!r} is SRC or lies inside it; choose a path "
                         "outside the source store")
    if dest.exists():
        if not dest.is_dir():
            raise SystemExit(f"dsa: DEST {a.dest!r} exists and is not a directory")
        is_store = _manifest(dest) is not None
        if not is_store and any(dest.iterdir()):
            raise SystemExit(f"dsa: DEST {a.dest!r} exists and is not a DSA store (it holds "
                             "other files, which --overwrite would delete); choose a new path")
        if is_store and not a.overwrite:
            raise SystemExit(f"dsa: DEST {a.dest!r} is an existing store; pass --overwrite "
                             "to replace it (or choose a new path)")
        if is_store and lock_held(dest / WRITER_LOCK):
            raise SystemExit(f"dsa: DEST {a.dest!r} is open for writing by a training "
                             "process; close it there first")
    if not st.store.info.reads_last_flush and lock_held(src_path / WRITER_LOCK):
        raise SystemExit(
            f"dsa: a writer holds SRC {a.src!r}: an in-place store's rows change on disk "
            "during training, ahead of the count in its manifest, so a copy now could pair "
            "rows and count of different steps. Close the training process (or write a "
            "checkpoint with dsa_core.checkpoint and convert that)")
    what = f"{st.num_rows:,} x {st.dim} {st.dtype.name}, count {st.count}"
    if not a.quiet:
        print(f"converting {a.src} ({st.storage}, {what}) to {a.dest} ({a.storage}) ...",
              file=sys.stderr)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # built beside DEST and renamed into place: a failure leaves DEST as it was
        with dsa_core.tools.staged_dir(dest, a.overwrite) as tmp:
            new = dsa_core.convert(st, tmp, storage=a.storage, memory=a.memory)
            dsa_core.close(new)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"dsa: converting {a.src!r} failed, {a.dest!r} was not changed: "
                         f"{exc}") from None
    note = (" (read at its writer's last flush)" if st.store.info.reads_last_flush
            and lock_held(src_path / WRITER_LOCK) else "")
    print(f"wrote {dest} (storage={a.storage}, {what}){note}")
    return 0


def cmd_bench(a) -> int:
    import dsa_core

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        st = dsa_core.create(Path(tmp) / "bench", a.rows, a.dim, curvature=a.curvature,
                             init="uniform", init_scale=1e-3, progress=False)
        ids = [rng.integers(0, a.rows, a.batch) for _ in range(a.steps + 10)]
        g = rng.standard_normal((a.batch, a.dim), dtype=np.float32)
        ts = []
        for k, idx in enumerate(ids):
            t0 = time.perf_counter()
            st = dsa_core.step(st, idx, g)
            if k >= 10:
                ts.append(time.perf_counter() - t0)
        dsa_core.close(st)
    med = float(np.median(ts))
    geo = "poincare" if a.curvature > 0 else "euclid"
    print(f"dsa_core {geo}: {a.rows:,} x {a.dim}, batch {a.batch}: {a.batch / med:,.0f} rows/s "
          f"(p50 {med * 1e3:.2f} ms, p99 {np.percentile(ts, 99) * 1e3:.2f} ms)")
    try:
        import torch
    except ImportError:
        return 0
    if a.curvature == 0:
        p = torch.nn.Parameter(torch.zeros(a.rows, a.dim))
        opt = torch.optim.SparseAdam([p], lr=1e-3)
        gt = torch.from_numpy(g)
        ts = []
        for k, idx in enumerate(ids):
            p.grad = torch.sparse_coo_tensor(torch.from_numpy(idx)[None], gt, p.shape,
                                             check_invariants=False)
            t0 = time.perf_counter()
            opt.step()
            if k >= 10:
                ts.append(time.perf_counter() - t0)
        tmed = float(np.median(ts))
        print(f"torch.optim.SparseAdam, same batches: {a.batch / tmed:,.0f} rows/s "
              f"-> dsa_core is {tmed / med:.1f}x")
    return 0


def _version() -> str:
    """``dsa X.Y.Z (store format vN)``: the version of the dsa_core that runs (its
    ``__version__``, which the installed distribution's metadata also carries)."""
    import dsa_core

    return f"dsa {dsa_core.__version__} (store format v{dsa_core.FORMAT_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dsa", description="Inspect, convert and benchmark DSA stores (out-of-core sparse "
        "Adam), in-place or log-structured. info, export, verify and convert open a store "
        "read-only, so they can run during training.")
    ap.add_argument("--version", action="version", version=_version(),
                    help="print the version of dsa-core (and of the store format) and exit")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    quiet = "no progress bar"

    p = sub.add_parser(
        "info", help="shape, dtype, curvature, count, hyperparameters, size of a store; "
        "or the stores in a directory (an optimizer's state_dir, a checkpoint)",
        description="Show a store's shape, dtype, geometry, count, hyperparameters, size and "
        "format, and whether a writer holds it now. The count is the one in manifest.json: "
        "with durability='flush' (the default), the count at the writer's last flush. On a "
        "directory that is not a store (an optimizer's state_dir, a checkpoint, the shards of "
        f"a ShardedDiskEmbedding), list the stores up to {SCAN_DEPTH} levels below it.")
    p.add_argument("store", metavar="PATH",
                   help="a store directory, or a directory holding stores")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("export", help="write the weights to a .npy file (chunked)",
                       description="Write a store's weights (in-place or log store, the same "
                       f"bytes) to a .npy file, in chunks of {CHUNK_BYTES >> 20} MiB of "
                       "records, without loading the table into memory.")
    p.add_argument("store", metavar="STORE", help="the store directory")
    p.add_argument("out", metavar="OUT.npy", help="the .npy file to write")
    p.add_argument("--force", action="store_true", help="overwrite OUT.npy if it exists")
    p.add_argument("--unclean", choices=("refuse", "accept"), default="refuse",
                   help="a store stopped uncleanly (rows may hold steps past its count): "
                   "refuse it (default) or export its rows as they are")
    p.add_argument("--quiet", action="store_true", help=quiet)
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("verify", help="check finiteness and (c > 0) that rows are in the ball",
                       description="Check a store's header and size, that every value is "
                       "finite and, for the Poincaré ball (c > 0), that every row lies inside "
                       "the ball; for a log store also every segment's and the index's "
                       "checksums and the index against the segments. Exit status 1 if a "
                       "problem is found.")
    p.add_argument("store", metavar="STORE", help="the store directory")
    p.add_argument("--quiet", action="store_true", help=quiet)
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser(
        "convert", help="copy a store into a new one of the other kind (in-place <-> log)",
        description="Copy every record, the hyperparameters and the count of SRC into a new "
        "store DEST of the kind --storage names (dsa_core.convert): training continues from "
        "DEST exactly as from SRC. SRC is opened read-only; DEST is built beside its path and "
        "renamed into place when complete, so a failure leaves DEST as it was. An in-place "
        "SRC must not be open for writing; a log SRC is read at its writer's last flush.")
    p.add_argument("src", metavar="SRC", help="the store to copy")
    p.add_argument("dest", metavar="DEST", help="the new store's directory")
    p.add_argument("--storage", required=True, choices=("log", "inplace"),
                   help="the kind of the new store: log (log-structured) or inplace")
    p.add_argument("--memory", type=memory_size, default=None, metavar="SIZE",
                   help="with --storage log: the region budget used while copying, e.g. 4GiB "
                   "or 512MiB (default: SRC's recorded one, else the core's; DEST remembers it)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DEST if it is an existing store")
    p.add_argument("--quiet", action="store_true", help="no progress message")
    p.set_defaults(fn=cmd_convert)

    p = sub.add_parser("bench", help="a quick warm benchmark of this machine",
                       description="Step a temporary store with random batches and report "
                       "rows/s (median of the steps after 10 warm-up steps); with torch "
                       "installed and c = 0, torch.optim.SparseAdam on the same batches.")
    p.add_argument("--rows", type=positive_int, default=200_000, metavar="N",
                   help="rows of the temporary table (default: %(default)s)")
    p.add_argument("--dim", type=positive_int, default=128, metavar="D",
                   help="embedding dimension (default: %(default)s)")
    p.add_argument("--batch", type=positive_int, default=2048, metavar="B",
                   help="row ids per step, drawn with replacement (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, default=100, metavar="S",
                   help="timed steps, after 10 warm-up steps (default: %(default)s)")
    p.add_argument("--curvature", type=nonnegative_float, default=0.0, metavar="C",
                   help="0: Euclidean (SparseAdam); > 0: Poincaré ball of curvature -C "
                   "(default: %(default)s)")
    p.add_argument("--workdir", type=existing_dir, default=None, metavar="DIR",
                   help="where to put the temporary store (default: the system temp dir); "
                   "use the disk you mean to train on")
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
