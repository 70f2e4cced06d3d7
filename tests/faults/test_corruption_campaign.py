"""Corruption at rest, at random: every damaged checkpoint is refused, and the damage is named.

One checkpoint (the tools' sample state: model, optimizer, RNG, dataloader and extra values,
three data files of 4 KiB hash chunks) is saved once; each trial damages a fresh copy:

- **bit flips** (120 trials): one random bit of one random file, data files and manifest alike;
- **truncation** (12): a random file cut to a random length; **extension** (4): bytes appended;
- **deleted file**: each data file, and the manifest;
- **manifest edited** (12): one random digit or hex letter of the manifest changed (as a person
  editing it by hand would, without resealing it); **manifest truncated** (6);
- **manifest from another checkpoint** copied in: as it is (its files are missing), and with
  the data files renamed to match it (the same layout, other values); and a data file of the
  other checkpoint copied in under this one's name.

Every trial must be detected twice: ``goodput_ckpt.tools.verify_checkpoint`` reports the
checkpoint corrupt (incomplete when the manifest is gone) with a problem naming the damaged file
and, for a data file, a byte range that covers the damage; and ``dcp.load`` through
``CheckpointReader(verify=True)`` raises with the same file (and range) in its error. A load
that returns, or a verify that passes, counts as data lost.

Trial counts scale with ``GOODPUT_FAULT_TRIALS`` (see ``_reliability``).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from _reliability import fault_trials, record
from helpers.samples import sample_state, save
from helpers.trees import assert_tree_equal, zeros_like
from torch.distributed.checkpoint.api import CheckpointException

from goodput_ckpt import CheckpointError, CheckpointReader
from goodput_ckpt.errors import find_checkpoint_error
from goodput_ckpt.format.manifest import MANIFEST_NAME
from goodput_ckpt.tools import verify_checkpoint

CHUNK = 4096
SEED = 8_100


@dataclass(frozen=True)
class Sample:
    path: Path
    state: dict
    files: dict[str, int]  # name -> size, manifest included


def _sample(path: Path, seed: int) -> Sample:
    sd = save(path, sample_state(seed), chunk_size=CHUNK, files_per_rank=3)
    return Sample(path, sd, {n: os.path.getsize(path / n) for n in sorted(os.listdir(path))})


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    base = tmp_path_factory.mktemp("campaign")
    a, b = _sample(base / "a", 0), _sample(base / "b", 1)
    assert len(a.files) == 4 and [n for n in a.files if n != MANIFEST_NAME] != [
        n for n in b.files if n != MANIFEST_NAME
    ]
    return a, b


@dataclass
class Damage:
    """What a trial did: the file it damaged and the byte range (``None`` for the manifest)."""

    what: str
    file: str
    lo: int | None = None
    hi: int | None = None
    status: str = "corrupt"  # what verify must say
    #: Whether a load's error must name a byte range too. Not for a deleted file: the load
    #: stops at the manifest check, whose "missing" error names the file and its keys.
    load_range: bool = True


# -- the damage -------------------------------------------------------------------------------------
def flip_bit(d: Path, a: Sample, rng: random.Random) -> Damage:
    name = rng.choice(sorted(a.files))
    pos, bit = rng.randrange(a.files[name]), rng.randrange(8)
    with open(d / name, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))
    return Damage(f"bit {bit} of byte {pos}", name, *_range(name, pos, pos + 1))


def truncate(d: Path, a: Sample, rng: random.Random) -> Damage:
    name = rng.choice(sorted(a.files))
    size = rng.randrange(a.files[name])
    os.truncate(d / name, size)
    return Damage(f"cut to {size} bytes", name, *_range(name, size, a.files[name]))


def extend(d: Path, a: Sample, rng: random.Random) -> Damage:
    name = rng.choice([n for n in a.files if n != MANIFEST_NAME])
    n = rng.randint(1, 100)
    with open(d / name, "ab") as f:
        f.write(rng.randbytes(n))
    return Damage(f"{n} bytes appended", name, a.files[name], a.files[name] + n)


def edit_manifest(d: Path, a: Sample, rng: random.Random) -> Damage:
    raw = bytearray((d / MANIFEST_NAME).read_bytes())
    spots = [i for i, c in enumerate(raw) if chr(c) in "0123456789abcdef"]
    i = rng.choice(spots)
    raw[i] = ord(rng.choice([c for c in "0123456789abcdef" if ord(c) != raw[i]]))
    (d / MANIFEST_NAME).write_bytes(bytes(raw))
    return Damage(f"byte {i} edited", MANIFEST_NAME)


def truncate_manifest(d: Path, a: Sample, rng: random.Random) -> Damage:
    size = rng.randrange(a.files[MANIFEST_NAME])
    os.truncate(d / MANIFEST_NAME, size)
    return Damage(f"manifest cut to {size} bytes", MANIFEST_NAME)


def _range(name: str, lo: int, hi: int) -> tuple[int | None, int | None]:
    return (None, None) if name == MANIFEST_NAME else (lo, hi)


def _data(s: Sample) -> list[str]:
    return [n for n in s.files if n != MANIFEST_NAME]


# -- the checks ----------------------------------------------------------------------------------
_RANGE = re.compile(r"\[(\d+), (\d+)\)")


def _overlaps(ranges, lo: int, hi: int) -> bool:
    return any(a < hi and lo < b for a, b in ranges)


def check_verify(d: Path, damage: Damage, names: set[str]) -> str | None:
    """Why ``verify`` missed ``damage`` (``None``: detected and named). ``names``: the files a
    problem may name (the damaged file, or the files of a foreign manifest)."""
    report = verify_checkpoint(str(d))
    # A flip that turns the version number into another one fails the seal too: damage, never
    # "unsupported" (a manifest from a newer goodput-ckpt).
    if report.status != damage.status:
        return f"verify said {report.status!r}, expected {damage.status!r}: {[p.message for p in report.problems]}"
    if damage.status == "incomplete":
        return None
    hits = [p for p in report.problems if p.file in names]
    if not hits:
        return f"no problem names {sorted(names)}: {[(p.kind, p.file) for p in report.problems]}"
    if damage.lo is not None and not _overlaps([p.byte_range for p in hits if p.byte_range], damage.lo, damage.hi):
        return f"no problem covers bytes [{damage.lo}, {damage.hi}): {[(p.file, p.byte_range) for p in hits]}"
    return None


def check_load(d: Path, damage: Damage, names: set[str], a: Sample) -> tuple[str | None, bool]:
    """Why a verified ``dcp.load`` missed ``damage``, and whether it returned wrong values."""
    dest = zeros_like(a.state)
    try:
        dcp.load(dest, storage_reader=CheckpointReader(str(d), verify=True))
    except CheckpointException as e:
        err = find_checkpoint_error(e)
        # A failure in read_metadata reaches us as torch's AssertionError text only (torch 2.13).
        text = str(err) if err is not None else str(e)
        ranges = (
            [err.byte_range]
            if err is not None and err.byte_range
            else [(int(x), int(y)) for x, y in _RANGE.findall(text)]
        )
    except CheckpointError as e:
        text, ranges = str(e), [e.byte_range] if e.byte_range else []
    else:
        try:
            assert_tree_equal(dest, a.state)
        except AssertionError:
            return "dcp.load returned wrong values without an error", True
        return "dcp.load succeeded", False
    if damage.status == "incomplete":
        return (
            None if "no manifest" in text or "never committed" in text else f"not reported incomplete: {text[-300:]}"
        ), False
    if not any(n in text for n in names):
        return f"the error does not name {sorted(names)}: {text[-400:]}", False
    if damage.lo is not None and damage.load_range and not _overlaps(ranges, damage.lo, damage.hi):
        return f"the error names no range covering [{damage.lo}, {damage.hi}): {ranges}", False
    return None, False


class Campaign:
    def __init__(self, samples: tuple[Sample, Sample], tmp: Path) -> None:
        self.a, self.b = samples
        self.tmp = tmp
        self.n = 0
        self.tally: dict[str, Counter] = {}
        self.misses: list[str] = []

    def copy(self) -> Path:
        self.n += 1
        d = self.tmp / f"t{self.n:04d}"
        shutil.copytree(self.a.path, d)
        return d

    def trial(self, category: str, d: Path, damage: Damage, names: set[str] | None = None) -> None:
        names = names or {damage.file}
        t = self.tally.setdefault(category, Counter())
        t["trials"] += 1
        by_verify = check_verify(d, damage, names)
        by_load, wrong = check_load(d, damage, names, self.a)
        t["verify"] += by_verify is None
        t["load"] += by_load is None
        t["detected"] += by_verify is None and by_load is None
        t["lost"] += wrong or by_verify is not None and "said 'ok'" in by_verify
        for who, miss in (("verify", by_verify), ("dcp.load", by_load)):
            if miss is not None:
                self.misses.append(f"{category}: {damage.what} in {damage.file}: {who}: {miss} (copy kept at {d})")
        if by_verify is None and by_load is None:
            shutil.rmtree(d)


def test_corruption_at_rest_is_always_detected_and_named(samples, tmp_path):
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    rng = random.Random(SEED)
    c = Campaign(samples, tmp_path)
    a, b = samples
    for category, damage_fn, count in (
        ("bit flip (random file, byte and bit)", flip_bit, fault_trials(120)),
        ("truncated file", truncate, fault_trials(12)),
        ("extended data file", extend, fault_trials(4)),
        ("manifest edited", edit_manifest, fault_trials(12)),
        ("manifest truncated", truncate_manifest, fault_trials(6)),
    ):
        for _ in range(count):
            d = c.copy()
            c.trial(category, d, damage_fn(d, a, rng))
    for name in _data(a):
        d = c.copy()
        os.remove(d / name)
        c.trial("deleted file", d, Damage("deleted", name, 0, a.files[name], load_range=False))
    d = c.copy()
    os.remove(d / MANIFEST_NAME)
    c.trial("deleted file", d, Damage("deleted", MANIFEST_NAME, status="incomplete"))

    # Another checkpoint's manifest: as it is (it names files that are not here) ...
    d = c.copy()
    shutil.copy(b.path / MANIFEST_NAME, d / MANIFEST_NAME)
    c.trial("manifest of another checkpoint", d, Damage("foreign manifest", MANIFEST_NAME), set(_data(b)))
    # ... and with this checkpoint's files renamed to its names (same sizes, other values).
    d = c.copy()
    shutil.copy(b.path / MANIFEST_NAME, d / MANIFEST_NAME)
    for mine, theirs in zip(_data(a), _data(b)):
        assert a.files[mine] == b.files[theirs]
        os.rename(d / mine, d / theirs)
    c.trial(
        "manifest of another checkpoint", d, Damage("foreign manifest, files renamed", MANIFEST_NAME), set(_data(b))
    )
    # A data file of the other checkpoint under this one's name.
    for mine, theirs in zip(_data(a), _data(b)):
        d = c.copy()
        shutil.copy(b.path / theirs, d / mine)
        c.trial("data file of another checkpoint", d, Damage("foreign data file", mine, 0, a.files[mine]))

    for category, t in c.tally.items():
        record(
            f"corruption at rest: {category}",
            "local",
            trials=t["trials"],
            faults_injected=t["trials"],
            detected_or_recovered=t["detected"],
            data_lost=t["lost"],
            detected_by_verify=t["verify"],
            detected_by_load=t["load"],
        )
    assert not c.misses, f"{len(c.misses)} misses:\n" + "\n".join(c.misses[:20])
    assert sum(t["trials"] for t in c.tally.values()) >= 100
