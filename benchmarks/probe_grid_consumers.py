"""What the consumers of a grid pay for a small manifest that describes many cells (issue 33).

The manifest is ``tests/format/_manifests.many_cells_manifest`` (about 186 KB, one grid of
4 M one-byte cells over 1,024 files; ``--files``/``--runs`` change it). Measured, each in a
fresh process, ``--repeats`` times:

- ``verify-quick``: ``verify_checkpoint(quick=True)`` on a location holding only the manifest
  (every data file missing: each problem names the keys stored in its file);
- ``tensor-bytes``: ``Manifest.tensor_bytes()`` on the parsed manifest (reshard's report).

For each: CPU seconds of the call (``time.process_time``) and the process's peak resident
memory (``ru_maxrss``: interpreter, imports and the parsed manifest included, about 80 MB of
it before the call) and how much the call raised it. Prints min / median / max.
``--package DIR`` puts another copy of the package first on the path (an older commit's tree,
for a before/after on the same machine); the child runs in a scratch directory so that the
current one does not shadow it. (The tests hold the same calls to a ``tracemalloc`` peak:
``tests/format/test_grid_consumers.py``; tracing the old code's 4 M records took over 10 min.)

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/probe_grid_consumers.py --repeats 3 [--package /path/to/old/tree]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, resource, sys, tempfile, time
sys.path.insert(0, {tests!r})
from _manifests import many_cells_manifest
from goodput_ckpt.format.manifest import MANIFEST_NAME, parse_manifest
from goodput_ckpt.tools.ops.verify import verify_checkpoint
import goodput_ckpt
raw = many_cells_manifest({files}, {runs})
where = tempfile.mkdtemp(prefix="probe-grid-")
with open(os.path.join(where, MANIFEST_NAME), "wb") as f:
    f.write(raw)
manifest = parse_manifest(raw)
call = {{"verify-quick": lambda: verify_checkpoint(where, quick=True).status,
         "tensor-bytes": manifest.tensor_bytes}}[{op!r}]
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.process_time()
result = call()
cpu = time.process_time() - t0
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {{"cpu_s": cpu, "peak_mb": rss1 / 1024, "growth_mb": (rss1 - rss0) / 1024, "result": str(result)}}
out.update(manifest_bytes=len(raw), package=os.path.dirname(goodput_ckpt.__file__))
os.remove(os.path.join(where, MANIFEST_NAME)); os.rmdir(where)
print(json.dumps(out))
"""


def _run(op: str, a: argparse.Namespace) -> dict:
    code = _CHILD.format(tests=str(ROOT / "tests" / "format"), files=a.files, runs=a.runs, op=op)
    env = dict(os.environ)
    path = [a.package] if a.package else []
    env["PYTHONPATH"] = os.pathsep.join(path + [str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=a.timeout,
        cwd=tempfile.gettempdir(),
    )
    if proc.returncode:
        raise SystemExit(f"{op}: the child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--files", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--package", help="a tree whose goodput_ckpt is measured instead of this one")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path, help="also write the measurements here")
    a = ap.parse_args(argv)
    rows = {}
    for op in ("verify-quick", "tensor-bytes"):
        got = [_run(op, a) for _ in range(a.repeats)]
        rows[op] = {k: [g[k] for g in got] for k in ("cpu_s", "peak_mb", "growth_mb")}
        rows[op].update(result=got[0]["result"], manifest_bytes=got[0]["manifest_bytes"], package=got[0]["package"])
    for op, r in rows.items():
        print(
            f"{op}: CPU s {_spread(r['cpu_s'])}, peak RSS MB {_spread(r['peak_mb'])}, raised by the call "
            f"{_spread(r['growth_mb'])} MB; median (min-max) of {a.repeats}; "
            f"{r['manifest_bytes']} B manifest, {a.files} x {a.runs} cells; result {r['result']}; {r['package']}"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
