"""benchmarks/bench_scale_save.py stays runnable: the ``tiny`` layout at 4 simulated ranks, one
repeat, each method. No assertion is about speed: the bytes each save exchanges are counts, and
the ones plan caching and compact plans remove (issue 37) are checked: from the second save on, our ranks send
digests and get empty plans and send their files without their rows, torch's send and get the
same bytes again, and the ``Metadata`` every rank receives from ours is slim. The traced repeat
(peak memory) and the step timed on every rank run too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_scale_save  # noqa: E402


def test_tiny_run_counts_what_plan_caching_removes(tmp_path, capsys):
    out = tmp_path / "save.json"
    argv = ["--layout", "tiny", "--ranks", "4", "--methods", "ours,ours-full,ours-nocache,torch", "--repeats", "1"]
    assert bench_scale_save.main([*argv, "--json", str(out)]) == 0
    rows = {r["method"]: r["saves"] for r in json.loads(out.read_text())["rows"]}
    ours, full, nocache, torch_ = (
        ({int(k): v["bytes"] for k, v in rows[m].items()}) for m in ("ours", "ours-full", "ours-nocache", "torch")
    )
    assert ours[1]["plans gathered"] > ours[2]["plans gathered"]  # digests, not plans
    assert full[1]["plans gathered"] > 100 * full[2]["plans gathered"]
    assert full[1]["plans gathered"] > 2 * ours[1]["plans gathered"]  # compact plans, not WriteItem lists
    assert full[1]["plans scattered"] > 10 * ours[1]["plans scattered"]
    assert ours[1]["plans scattered"] > ours[2]["plans scattered"]  # empty plans
    assert nocache[2]["plans gathered"] == nocache[1]["plans gathered"]
    assert torch_[2]["plans gathered"] == torch_[1]["plans gathered"]
    assert ours[2]["Metadata broadcast"] < 200 < torch_[2]["Metadata broadcast"]
    # the write results: every rank's rows at the first save, files and a digest from the second on
    assert ours[1]["results gathered"] > 4 * ours[2]["results gathered"]
    assert torch_[2]["results gathered"] == torch_[1]["results gathered"]
    saves = rows["ours"]
    assert all(saves[k]["coordinator peak MB"] is not None for k in saves)  # the traced repeat ran
    assert all(saves[k]["step 3 worst of all other ranks cpu s"]["rank"] in (1, 2, 3) for k in saves)
    assert "coordinator" in capsys.readouterr().out


def test_the_fit_extrapolates_a_line_and_reads_the_benchmark_json(tmp_path, capsys):
    import bench_scale_save_fit as fit_mod

    a, b, worst = fit_mod.fit([(16, 1.0 + 16 * 0.5), (64, 1.0 + 64 * 0.5), (256, 1.0 + 256 * 0.5)])
    assert abs(a - 1.0) < 1e-9 and abs(b - 0.5) < 1e-9 and worst < 1e-9

    def row(world: int, cpu: float) -> dict:
        later = {
            "coordinator cpu s": {"median": cpu},
            "rank 1 cpu s": {"median": 0.1},
            "bytes": {"results gathered": 100 * world},
        }
        return {"method": "ours", "world": world, "saves": {"2": later}}

    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"rows": [row(16, 0.2), row(64, 0.2)]}))
    assert fit_mod.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "ours, later save, results gathered (bytes)" in out and "b=100/rank" in out
    assert "coordinator cpu s: W=16: 0.2; W=64: 0.2; no growth with W resolved" in out


def test_the_gathers_are_counted_padded_and_the_peak_by_window(tmp_path):
    out = tmp_path / "save.json"
    assert (
        bench_scale_save.main(
            ["--layout", "tiny", "--ranks", "4", "--methods", "ours", "--repeats", "1", "--json", str(out)]
        )
        == 0
    )
    first = json.loads(out.read_text())["rows"][0]["saves"]["1"]
    b = first["bytes"]
    assert b["plans gathered, padded"] >= b["plans gathered"] and b["results gathered, padded"] >= b["results gathered"]
    windows = first["coordinator peak windows"]
    assert max(windows["plan window MB"], windows["commit window MB"]) == first["coordinator peak MB"]


def test_the_sample_of_ranks_runs(capsys):
    import bench_scale_save_sample

    assert bench_scale_save_sample.main(["--layout", "tiny", "--world", "64", "--sample", "4"]) == 0
    assert "plans gathered, padded to the largest" in capsys.readouterr().out


def _saves(ranks, root) -> tuple[list[dict], dict[str, bytes], list[int]]:
    """Two saves of ``ranks``: each save's byte counts, the files the coordinator committed, and
    the ``Metadata``'s tensor and chunk counts."""
    from goodput_ckpt.dcp.commit_build import forget_layouts

    forget_layouts()  # the coordinator's held layouts are this process's: each mode starts without
    counts, meta, end_save = [], [], ranks.end_save

    def end_and_count() -> None:  # the coordinator's Metadata, before the save's objects are dropped
        md = ranks.coordinator()[0].metadata.state_dict_metadata
        meta.extend([len(md), sum(len(getattr(m, "chunks", ())) for m in md.values())])
        end_save()

    ranks.end_save = end_and_count
    try:
        for save in (1, 2):
            clock = bench_scale_save.Clock()
            bench_scale_save.one_save(ranks, save, clock, traced=save == 1)
            counts.append({k: v for k, v in clock.bytes.items() if not k.endswith(" MB")})  # MB: measured
    finally:
        ranks.close()
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return counts, files, meta


def test_streamed_ranks_give_the_same_commit_records_and_payloads(tmp_path, monkeypatch):
    """``--stream``: the ranks other than the timed ones run in worker processes, each rebuilt per
    step; the coordinator must get the same payloads and commit the same records as with every
    rank in this process (tokens and timestamps fixed so that the records compare byte for byte)."""
    import secrets

    import bench_scale_save_stream

    import goodput_ckpt.dcp.writer as writer_mod

    monkeypatch.setattr(secrets, "token_hex", lambda n=8: "ab" * n)  # every rank's calls, in any process
    monkeypatch.setattr(writer_mod, "_now_utc", lambda: "2026-12-08T00:00:00Z")
    world = 7  # timed ranks 0, 1, 3; the other 4 in 3 workers (one with 2 ranks)
    runs = {}
    bench_scale_save_stream.forget_payloads()
    for mode in ("in-process", "streamed", "streamed again"):  # again: the first's payloads, kept
        root = tmp_path / mode
        root.mkdir()
        ranks = (
            bench_scale_save.Ranks("ours", "tiny", world, str(root))
            if mode == "in-process"
            else bench_scale_save_stream.StreamedRanks("ours", "tiny", world, str(root), 3)
        )
        runs[mode] = _saves(ranks, root)
    bench_scale_save_stream.forget_payloads()
    counts, files, meta = runs.pop("in-process")
    assert meta[1] > 0 and len(files) >= 2  # a commit record for each save
    for mode, (counts_b, files_b, meta_b) in runs.items():
        assert (counts_b, meta_b) == (counts, meta), mode
        assert files_b == files, mode  # byte for byte
