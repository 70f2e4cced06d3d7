"""Run the reliability suite and print what was tried and what happened (issue 8).

The suite is ``tests/faults`` (SIGKILL at random instants on local disk, S3 and a mounted
volume; full disks and file-size limits; S3 faults through a loopback proxy; random corruption
at rest; two writers and a racing reader), plus the hostile-manifest corpus
(``tests/format/test_manifest_hostile.py``) and the S3 fault tests of the store
(``tests/storage/test_s3_faults.py``), and the hostile-input and destructive-path tests
(``HOSTILE`` below; ``--hostile`` runs only them), and the two-tier tests (``TIERS``, ``--tiers``). It runs here, in this process, through pytest; slow
tests included unless ``--quick``.

Where the rows come from: each scenario of ``tests/faults`` appends its own line to a JSON-lines
file (the ``GOODPUT_RELIABILITY_LOG`` variable, see ``tests/faults/_reliability.py``): trials,
faults injected, detected or recovered, data lost. Test modules that write no lines (the older
SIGKILL and corruption tests, the hostile corpus, the S3 store's fault tests) get one row each
from their test outcomes: one trial per test case, detected = passed, data lost = failed.

Output: the table; the known bugs (tests marked ``xfail``, with their reasons); failures, if any.
Exit status 1 when a test failed or any row lost data.

Run (what docs/reliability.md shows)::

    .venv/bin/python benchmarks/reliability_report.py [--long] [--quick] [--trials N] [--json out.json]

``--long`` sets ``GOODPUT_FAULT_TRIALS=100`` (default 30): 100 SIGKILL trials per backend,
400 bit flips, and the other randomized scenarios scaled alike. Needs root for the tmpfs and
FUSE tests (they skip otherwise, and the skips are listed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["tests/faults", "tests/format/test_manifest_hostile.py", "tests/storage/test_s3_faults.py"]
LOG_ENV, TRIALS_ENV = "GOODPUT_RELIABILITY_LOG", "GOODPUT_FAULT_TRIALS"  # as in tests/faults/_reliability.py
#: Modules that write no result lines: one row each, from their test outcomes.
FROM_OUTCOMES = {
    "tests/faults/test_sigkill.py": ("SIGKILL during one dcp.save (256 MiB; new location, overwrite) [tests]", "local"),
    "tests/faults/test_corruption.py": ("corruption: targeted flips, truncation, garbled manifests [tests]", "local"),
    "tests/format/test_manifest_hostile.py": (
        "hostile manifests: traversal, absurd sizes, pickle payloads [tests]",
        "local",
    ),
    "tests/storage/test_s3_faults.py": (
        "S3 faults: 503, 500, resets, stalls, cut bodies; count and probability [tests]",
        "s3 (moto)",
    ),
}
#: Hostile inputs and destructive paths (issue 16): one row per module, from its test outcomes;
#: ``--hostile`` runs only these.
HOSTILE = {
    "tests/storage/test_no_escape.py": (
        "hostile: links inside a location; overwrite deletes only what it owns [tests]",
        "local",
    ),
    "tests/tools/ops/test_destination_alias.py": (
        "hostile: destination an alias of the source (link, bind mount, .., nested) [tests]",
        "local",
    ),
    "tests/tools/ops/test_hostile_verdicts.py": (
        "hostile: corpus through verify, inspect and dcp.load, one verdict [tests]",
        "local",
    ),
    "tests/format/test_tiling.py": ("hostile: adversarial chunk tilings (staircase), bounded work [tests]", "format"),
    "tests/format/test_parse_memory.py": ("hostile: parse memory per manifest byte bounded [tests]", "format"),
    "tests/tools/ops/test_verify.py": (
        "hostile: verify buffers bounded by file sizes; verify verdicts [tests]",
        "local",
    ),
    "tests/tools/test_formats_dcp_fs.py": ("hostile: DCP .metadata claims, pickles passed through [tests]", "local"),
    "tests/tools/test_formats_safetensors.py": (
        "hostile: safetensors headers as the reference library judges [tests]",
        "local",
    ),
    "tests/engine/test_untrusted_load.py": ("hostile: deflate bombs, refused pickles named [tests]", "local"),
    "tests/cli/test_cli_errors.py": ("hostile: no tracebacks, data errors exit 1 [tests]", "cli"),
    "tests/cli/test_cli_escaping.py": ("hostile: control characters escaped in human output [tests]", "cli"),
    "tests/storage/test_redact.py": ("hostile: credentials in URLs never echoed [tests]", "all"),
    "tests/storage/test_contract.py": ("hostile: capped small reads, one error type per event [tests]", "all"),
    "tests/format/test_grid_consumers.py": (
        "hostile: 186 KB manifest of 4 M grid cells: verify, inspect, load, reshard per run, counted [tests]",
        "local",
    ),
    "tests/format/test_key_index.py": (
        "hostile: keys of a byte range found run by run, bounded work [tests]",
        "format",
    ),
    "tests/manager/test_retention_unsafe_keys.py": (
        "hostile: unsafe keys in step directories skipped, retention goes on [tests]",
        "s3 (moto)",
    ),
    # Issue 33: the training state (loader rows, data positions, generator slots), bounded like the manifest.
    "tests/data/test_saved_state_hostile.py": (
        "hostile: saved loader state: counts, cycles, stride-0 bitmaps, bombs, RNG slots, token shards [tests]",
        "local",
    ),
    "tests/state/test_restore_hostile.py": (
        "hostile: loader state through restore, both paths: refused before model, optimizer, loader, RNG, objects change [tests]",
        "local",
    ),
}
#: Two-tier checkpoints (issue 18): lost nodes, damaged copies, SIGKILL during local saves,
#: replication and persistent uploads; ``--tiers`` runs only these.
TIERS = {
    "tests/manager/test_tiers.py": (
        "two tiers: lost node, damaged local copies and replicas, fallback tier by tier [tests]",
        "local (4 ranks, 2 nodes)",
    ),
    "tests/manager/test_tiers_acceptance.py": (
        "two tiers: FSDP2 job, 4 failures restored bit-exact; SIGKILL in local save/replication/persist [tests]",
        "local (4 ranks, 2 nodes)",
    ),
}
FROM_OUTCOMES.update(HOSTILE)
FROM_OUTCOMES.update(TIERS)
SUITE += list(HOSTILE) + list(TIERS)
COLUMNS = ("scenario", "backend", "trials", "faults_injected", "detected_or_recovered", "data_lost")
HEADERS = ("scenario", "backend", "trials", "faults injected", "detected or recovered", "data lost")


class Outcomes:
    """A pytest plugin that keeps each test's outcome (and the reason of each xfail and skip)."""

    def __init__(self) -> None:
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "why": ""})
        entry["seconds"] += report.duration
        if report.when == "call" and hasattr(report, "wasxfail"):
            entry.update(outcome="xpassed" if report.passed else "xfailed", why=report.wasxfail)
        elif report.failed:
            entry.update(outcome="failed", why=str(report.longrepr)[-3000:])
        elif report.skipped and entry["outcome"] == "passed":
            entry.update(outcome="skipped", why=str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else "")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def rows_from(lines: list[dict[str, Any]], outcomes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (scenario, backend): the result lines summed, then the outcome rows."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for line in lines:
        blank = {"scenario": line["scenario"], "backend": line["backend"], **{c: 0 for c in COLUMNS[2:]}, "details": []}
        row = rows.setdefault((line["scenario"], line["backend"]), blank)
        for c in COLUMNS[2:]:
            row[c] += line[c]
        if line.get("details"):
            row["details"].append(line["details"])
    by_module: dict[str, list[str]] = defaultdict(list)
    for nodeid, entry in outcomes.items():
        by_module[module_of(nodeid)].append(entry["outcome"])
    for module, (scenario, backend) in FROM_OUTCOMES.items():
        seen = [o for o in by_module.get(module, []) if o in ("passed", "failed")]
        if seen:
            rows[(scenario, backend)] = {
                "scenario": scenario,
                "backend": backend,
                "trials": len(seen),
                "faults_injected": len(seen),
                "detected_or_recovered": seen.count("passed"),
                "data_lost": seen.count("failed"),
                "details": [],
            }
    return list(rows.values())


def merged(details: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``details`` of a row's result lines, numbers summed (also one level down)."""
    out: dict[str, Any] = {}
    for d in details:
        for k, v in d.items():
            if isinstance(v, dict):
                sub = out.setdefault(k, {})
                for k2, v2 in v.items():
                    sub[k2] = sub.get(k2, 0) + v2
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            else:
                out[k] = v
    return out


def table(rows: list[dict[str, Any]]) -> str:
    cells = [HEADERS] + [tuple(str(r[c]) for c in COLUMNS) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADERS))]
    out = []
    for n, row in enumerate(cells):
        out.append(
            "| " + " | ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))) + " |"
        )
        if n == 0:
            out.append(
                "|" + "|".join(("-" * (w + 2)) if i < 2 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
            )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--long", action="store_true", help="more trials (GOODPUT_FAULT_TRIALS=100)")
    ap.add_argument(
        "--trials", type=int, help="trials per backend for the randomized scenarios (default 30, --long 100)"
    )
    ap.add_argument("--quick", action="store_true", help="leave out the tests marked slow")
    ap.add_argument("--json", type=Path, help="also write the rows and the outcomes to this file")
    ap.add_argument("-k", dest="keyword", help="only the tests pytest -k selects")
    ap.add_argument("--hostile", action="store_true", help="only the hostile-input and destructive-path tests")
    ap.add_argument("--tiers", action="store_true", help="only the two-tier tests")
    args = ap.parse_args(argv)
    trials = args.trials or (100 if args.long else 30)
    if trials < 1:
        ap.error("--trials must be positive")

    import pytest

    os.chdir(ROOT)
    log = Path(tempfile.mkdtemp(prefix="goodput-reliability-")) / "results.jsonl"
    os.environ[LOG_ENV], os.environ[TRIALS_ENV] = str(log), str(trials)
    pytest_args = [
        *(HOSTILE if args.hostile else TIERS if args.tiers else SUITE),
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
    ]
    if args.quick:
        pytest_args += ["-m", "not slow"]
    if args.keyword:
        pytest_args += ["-k", args.keyword]
    plugin = Outcomes()
    t0 = time.monotonic()
    rc = pytest.main(pytest_args, plugins=[plugin])
    seconds = time.monotonic() - t0
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    rows = rows_from(lines, plugin.tests)
    by = lambda o: sorted((n, e["why"]) for n, e in plugin.tests.items() if e["outcome"] == o)  # noqa: E731
    failed, xfailed, xpassed, skipped = by("failed"), by("xfailed"), by("xpassed"), by("skipped")
    outcomes = [e["outcome"] for e in plugin.tests.values()]
    counts = {o: outcomes.count(o) for o in ("passed", "failed", "xfailed", "xpassed", "skipped")}

    command = " ".join(["benchmarks/reliability_report.py", *argv])
    print(f"\n## Reliability report: {command}")
    print(
        f"{TRIALS_ENV}={trials}; {len(plugin.tests)} tests in {seconds:.0f} s: "
        + ", ".join(f"{n} {o}" for o, n in counts.items() if n)
        + "\n"
    )
    print(table(rows))
    notes = [(r, merged(r["details"])) for r in rows if r["details"]]
    if notes:
        print("\nDetails:")
        for r, d in notes:
            parts = [
                f"{k}: " + (", ".join(f"{k2} {v2}" for k2, v2 in v.items()) if isinstance(v, dict) else str(v))
                for k, v in d.items()
            ]
            print(f"- {r['scenario']} ({r['backend']}): {'; '.join(parts)}")
    if xfailed or xpassed:
        print("\nKnown bugs (tests marked xfail):")
        for nodeid, why in xfailed + xpassed:
            print(f"- {nodeid}{' (now PASSES: remove its xfail marker)' if (nodeid, why) in xpassed else ''}: {why}")
    if skipped:
        print("\nSkipped:")
        for nodeid, why in skipped:
            print(f"- {nodeid}: {why}")
    if failed:
        print("\nFAILED:")
        for nodeid, why in failed:
            print(f"- {nodeid}\n{why[-1500:]}")
    lost = sum(r["data_lost"] for r in rows)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "command": command,
                    "trials_per_backend": trials,
                    "seconds": round(seconds, 1),
                    "pytest_exit": int(rc),
                    "counts": counts,
                    "rows": rows,
                    "known_bugs": [{"test": n, "reason": w} for n, w in xfailed + xpassed],
                    "failed": [n for n, _ in failed],
                    "skipped": [{"test": n, "reason": w} for n, w in skipped],
                },
                indent=2,
            )
        )
    return 1 if failed or lost or rc != 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
