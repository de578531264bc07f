"""Which dsa_core modules one step passes through, per store kind (a structure measurement).

    python -m benchmarks.step_modules                  # this checkout
    python benchmarks/step_modules.py --repo OLD_TREE  # another checkout (e.g. a git worktree)

Counts the dsa_core source files whose Python functions one warm ``dsa_core.step`` calls
(with ``sys.setprofile``) and the hops between files, on an in-place store and on a log store
whose region (752 slots of a 2 MiB budget) is full (the step evicts and seals). Numba kernels
count as one call each.
"""
import argparse
import sys
import tempfile


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=None, help="import dsa_core from this tree")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.repo:
        sys.path.insert(0, a.repo)
    import numpy as np

    import dsa_core

    out = {}

    def trace(st, idx, g):
        files, hops, last = [], 0, None

        def prof(frame, event, arg):
            nonlocal hops, last
            if event != "call":
                return
            f = frame.f_code.co_filename
            if "/dsa_core/" not in f:
                return
            name = f.split("/dsa_core/")[1]
            if name not in files:
                files.append(name)
            if last is not None and name != last:
                hops += 1
            last = name
        sys.setprofile(prof)
        try:
            st = dsa_core.step(st, idx, g)
        finally:
            sys.setprofile(None)
        return st, files, hops

    with tempfile.TemporaryDirectory() as tmp:
        for storage, mem in (("inplace", None), ("log", 2 << 20)):
            st = dsa_core.create(f"{tmp}/{storage}", 20000, 64, storage=storage, memory=mem,
                                 init="uniform", progress=False)
            rng = np.random.default_rng(0)
            g = np.ones((512, 64), np.float32)
            for _ in range(30):
                st = dsa_core.step(st, rng.integers(0, 20000, 512), g)
            st, files, hops = trace(st, rng.integers(0, 20000, 512), g)
            out[storage] = {"modules": len(files), "hops": hops, "files": files}
            dsa_core.close(st)
    print(f"{'storage':>8} {'modules':>8} {'hops':>5}  files")
    for k, v in out.items():
        print(f"{k:>8} {v['modules']:>8} {v['hops']:>5}  {' '.join(v['files'])}")
    return out


if __name__ == "__main__":
    main()
