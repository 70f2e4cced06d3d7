"""bench: the report's figures hang together, it cleans up, and the command renders it.

Every bench here is small (8 MiB, one repeat: a few seconds). No assertion is about speed: only
about what was measured, how the figures relate and what is left behind.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
from helpers.s3 import MotoServer, s3_env

from goodput_ckpt.cli import EXIT_USAGE, main
from goodput_ckpt.tools.measure._bench_plot import plot_report
from goodput_ckpt.tools.measure.bench import BENCH_SCHEMA, SAMPLES, BenchReport, bench
from goodput_ckpt.tools.ops.verify import verify_checkpoint

SIZE = 8 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """(report, progress lines, the directory it ran in) of one bench in the current directory."""
    cwd = tmp_path_factory.mktemp("bench-cwd")
    lines: list[str] = []
    old = os.getcwd()
    os.chdir(cwd)
    try:
        report = bench(size=SIZE, repeats=1, progress=lines.append, quiet=0)
    finally:
        os.chdir(old)
    return report, lines, cwd


def test_local_report_is_consistent_and_cleaned_up(local_run):
    r, lines, cwd = local_run
    assert list(cwd.iterdir()) == []  # the goodput-bench-* directory is gone
    assert r.backend == "local" and r.uri == str(cwd) and Path(r.root).parent == cwd
    assert Path(r.root).name.startswith("goodput-bench-") and r.kept == []
    assert r.requested_bytes == SIZE and 0.9 * SIZE <= r.size_bytes <= SIZE and r.tensors > 400
    assert r.repeats == 1 and r.cold_cache is True and r.host["cpus"] >= 1 and r.seconds > 0
    assert [m.name for m in r.methods] == ["goodput", "torch"]
    for m in r.methods:
        assert m.available and m.reason is None and m.payload_bytes == r.size_bytes
        for s in ("save_s", "load_s", "stall_s", "async_total_s"):
            assert len(getattr(m, s)) == 1 and getattr(m, s)[0] > 0, (m.name, s)
        assert m.stall_s[0] <= m.async_total_s[0]  # the stall is a part of the async save
        assert m.save_gbps == pytest.approx(r.size_bytes / m.save_s[0] / 1e9)
        assert m.load_gbps == pytest.approx(r.size_bytes / m.load_s[0] / 1e9)
        assert m.files >= 2 and m.stored_bytes > r.size_bytes  # data plus the commit record
    ours, theirs = r.methods
    assert ours.writer.startswith("CheckpointWriter") and theirs.writer.startswith("FileSystemWriter")
    assert len(ours.verify_s) == 1 and r.size_bytes <= ours.verify_bytes < ours.stored_bytes
    assert ours.verify_gbps == pytest.approx(ours.verify_bytes / ours.verify_s[0] / 1e9)
    assert theirs.verify_s == [] and theirs.verify_gbps is None and theirs.verify_reason.startswith("n/a")
    assert r.ratios["save_gbps"] == pytest.approx(ours.save_gbps / theirs.save_gbps)
    assert r.ratios["stall_s"] == pytest.approx(ours.stall_s[0] / theirs.stall_s[0])
    assert any(line.startswith("[1/1] goodput: save ") for line in lines)
    assert any(line.startswith("[1/1] torch: save ") for line in lines) and lines[-1].startswith("removing ")


def test_json_round_trip_and_stable_keys(local_run):
    r = local_run[0]
    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))
    assert BenchReport.from_json(doc) == r
    assert doc["schema"] == BENCH_SCHEMA and doc["gb"] == 1e9
    assert set(doc) == {
        "schema",
        "gb",
        "uri",
        "root",
        "backend",
        "size_bytes",
        "requested_bytes",
        "tensors",
        "repeats",
        "seed",
        "thread_count",
        "torch_thread_count",
        "cold_cache",
        "host",
        "methods",
        "kept",
        "seconds",
        "ratios",
        "quiet",
        "order",
        "loadavg",
        "ratio_spread",
    }
    m = doc["methods"][0]
    assert set(m["samples"]) == set(m["median"]) == set(SAMPLES)
    assert {
        "name",
        "writer",
        "reader",
        "available",
        "reason",
        "save_gbps",
        "load_gbps",
        "verify_gbps",
        "stall_s_median",
        "files",
        "stored_bytes",
        "verify_bytes",
        "payload_bytes",
    } <= set(m)
    assert m["median"]["stall_s"] == m["stall_s_median"] == m["samples"]["stall_s"][0]
    for added in ("quiet", "order", "loadavg"):  # an older report, without the keys added since, still reads
        del doc[added]
    for m in doc["methods"]:
        del m["save_cpu_s"], m["save_other_cpus"]
    assert BenchReport.from_json(doc).order == []
    with pytest.raises(ValueError, match="not a goodput-ckpt bench report"):
        BenchReport.from_json({"schema": "something/else"})
    del doc["methods"][0]["samples"]
    with pytest.raises(ValueError, match="malformed"):
        BenchReport.from_json(doc)


def test_two_repeats_rotate_and_ratios_are_per_repeat(tmp_path):
    """The shared procedure: the order alternates, saves come before every stall, and the
    per-repeat ratios pair each repeat's samples (tools/measure/_bench_measure.py)."""
    lines: list[str] = []
    r = bench(tmp_path, size=SIZE, repeats=2, quiet=0, progress=lines.append)
    assert r.order == [["goodput", "torch"], ["torch", "goodput"]] and r.quiet == 0 and len(r.loadavg) == 2
    steps = [
        line.split(": ", 1) for line in lines if line.startswith("[") and line.endswith(("verify", "load", "stall"))
    ]
    assert steps == [
        ["[1/2] goodput", "save, load, verify"],
        ["[1/2] torch", "save, load"],
        ["[2/2] torch", "save, load"],
        ["[2/2] goodput", "save, load, verify"],
        ["[1/2] goodput", "stall"],
        ["[1/2] torch", "stall"],
        ["[2/2] torch", "stall"],
        ["[2/2] goodput", "stall"],
    ]
    ours, theirs = r.methods
    assert len(ours.save_cpu_s) == len(theirs.save_other_cpus) == 2 and min(ours.save_cpu_s) > 0
    sp = r.ratio_spreads
    assert sp["save_gbps"].per_repeat == tuple(t / o for o, t in zip(ours.save_s, theirs.save_s))
    assert sp["load_gbps"].per_repeat == tuple(t / o for o, t in zip(ours.load_s, theirs.load_s))
    assert sp["stall_s"].per_repeat == tuple(o / t for o, t in zip(ours.stall_s, theirs.stall_s))
    doc = r.to_json()["ratio_spread"]["save_gbps"]
    assert (doc["min"], doc["median"], doc["max"]) == (sp["save_gbps"].min, sp["save_gbps"].median, sp["save_gbps"].max)
    assert list(tmp_path.iterdir()) == []


def test_plot_is_a_png(local_run, tmp_path):
    from PIL import Image

    path = tmp_path / "bench.png"
    plot_report(local_run[0], path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (1200, 504)  # 10 x 4.2 inches at 120 dpi
        im.verify()


def test_keep_leaves_the_last_checkpoints(tmp_path):
    r = bench(tmp_path / "new" / "dir", size=SIZE, repeats=1, keep=True, quiet=0)
    assert len(r.kept) == 2 and all(Path(k).is_dir() for k in r.kept)
    assert sorted(p.name for p in Path(r.root).iterdir()) == ["goodput-0", "torch-0"]  # the rest removed
    assert verify_checkpoint(r.kept[0]).ok and (Path(r.kept[1]) / ".metadata").is_file()


def test_volume_mode_is_reported(tmp_path):
    r = bench(tmp_path, size=SIZE, repeats=1, volume=True, quiet=0)  # the volume store, forced on a local path
    assert r.backend == "volume" and all(m.available for m in r.methods) and r.methods[0].verify_s
    assert list(tmp_path.iterdir()) == []


def test_cli_table_json_and_plot(tmp_path):
    code, out, err = run("bench", tmp_path / "t", "--size", "8MiB", "--repeats", "1", "--quiet", "0")
    assert code == 0, err
    assert "per repeat: ours/torch min / median / max: save " in out and "order:   1: goodput, torch" in out
    head, *rows = out.splitlines()
    assert head.split() == ["METHOD", "SAVE", "GB/s", "LOAD", "GB/s", "SAVE", "s", "STALL", "s", "VERIFY", "GB/s"]
    assert rows[0].startswith("goodput ") and rows[1].startswith("torch ") and rows[2].startswith("ours/torch ")
    assert "n/a: no checksums" in rows[1] and rows[2].split()[1].endswith("x")
    assert "FileSystemWriter" in out and "page cache evicted" in out and "removed after the run" in out
    assert "[1/1] goodput: save" in err and not (tmp_path / "t").exists()

    png = tmp_path / "out.png"
    code, out, err = run(
        "bench",
        tmp_path / "j",
        "--size",
        "8MiB",
        "--repeats",
        "1",
        "--json",
        "--no-progress",
        "--quiet",
        "0",
        "--plot",
        png,
    )
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["schema"] == BENCH_SCHEMA and doc["requested_bytes"] == SIZE and len(doc["methods"]) == 2
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib... raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    code, out, err = run("bench", tmp_path / "p", "--size", "8MiB", "--plot", tmp_path / "x.png")
    assert code == EXIT_USAGE and out == ""
    assert "matplotlib" in err and "goodput-ckpt[plot]" in err and "Traceback" not in err
    assert not (tmp_path / "p").exists() and not (tmp_path / "x.png").exists()  # failed before running
    with pytest.raises(ImportError, match=r"goodput-ckpt\[plot\]"):
        plot_report(None, tmp_path / "y.png")


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--size", "lots"), "invalid size 'lots'"),
        (("--size", "1.5XB"), "invalid size"),
        (("--size", "1MiB"), "at least 4 MiB"),
        (("--repeats", "0"), "repeats must be a positive integer"),
        (("--quiet", "-1"), "quiet must be 0 or more"),
        (("-o", "no_such_option=1"), "unknown option"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys, argv, message):
    code, out, err = run("bench", tmp_path / "b", *argv)
    err += capsys.readouterr().err  # argparse's own errors go to sys.stderr
    assert code == EXIT_USAGE and message in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


# -- S3 (moto) ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moto_url():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_env().items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        server = MotoServer()
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def bucket(moto_url, request):
    import boto3

    client = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1")
    name = f"bench-{request.node.name.replace('_', '-')[:40].lower()}"
    client.create_bucket(Bucket=name)
    return client, name


S3_OPTIONS = ("-o", "addressing_style=path", "-o", "region=us-east-1")


def test_s3_bench_against_moto(moto_url, bucket):
    client, name = bucket
    r = bench(
        f"s3://{name}/scratch",
        size=SIZE,
        repeats=1,
        endpoint_url=moto_url,
        addressing_style="path",
        region="us-east-1",
        quiet=0,
    )
    assert r.backend == "s3" and r.cold_cache is None and r.root.startswith(f"s3://{name}/scratch/goodput-bench-")
    ours, theirs = r.methods
    assert ours.available and ours.save_gbps > 0 and ours.load_gbps > 0 and ours.verify_gbps > 0
    try:
        import s3fs  # noqa: F401 - the bench extra
    except ImportError:
        assert not theirs.available and "s3fs" in theirs.reason
    else:
        assert theirs.available and theirs.writer.startswith("FsspecWriter") and theirs.load_gbps > 0
    assert client.list_objects_v2(Bucket=name).get("KeyCount") == 0  # everything removed
    assert not client.list_multipart_uploads(Bucket=name).get("Uploads")


def test_s3_without_s3fs_reports_torch_as_na(moto_url, bucket, monkeypatch):
    import fsspec

    def missing(protocol):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    client, name = bucket
    code, out, err = run(
        "bench",
        f"s3://{name}",
        "--size",
        "8MiB",
        "--repeats",
        "1",
        "--quiet",
        "0",
        "-o",
        f"endpoint_url={moto_url}",
        *S3_OPTIONS,
    )
    assert code == 0, err
    rows = out.splitlines()
    assert rows[1].startswith("goodput ") and "n/a" not in rows[1]
    assert rows[2].split() == ["torch", "n/a", "n/a", "n/a", "n/a", "n/a"]
    assert rows[3].split()[1:] == ["-", "-", "-", "-", "-"]  # no ratios without torch's figures
    assert "n/a: torch's FsspecWriter cannot reach s3:// here (pip install s3fs)" in out
    assert "remote storage" in out
    assert client.list_objects_v2(Bucket=name).get("KeyCount") == 0
