"""Regenerate the hostile-manifest corpus in this folder: ``python make_corpus.py``.

Every ``*.json`` here is a manifest that a reader must refuse with a clean
:class:`goodput_ckpt.CheckpointError` (never a ``KeyError``, ``IndexError``, ``ValueError``, ...),
and never a read outside the checkpoint. ``expected.json`` says, for each file, which error
``parse_manifest`` raises (``null``: the manifest parses, the problem is only visible against the
files on disk), which error ``CheckpointReader(path).read_metadata()`` raises, and a fragment its
message must contain. ``valid.json`` is the unmodified base, the control.

All manifests describe the same checkpoint: two data files of zeros (their digests are real, so
``valid.json`` beside those files is a loadable checkpoint)::

    rank00000-00.0123456789ab.bin  8256 bytes: "w" float32 [16, 128] at 0, "step" object at 8192
    rank00000-01.0123456789ab.bin    32 bytes: "b" int64 [4] at 0

The tests (test_manifest_hostile.py) recreate those files next to each manifest. Files are
written as bytes, so a case may hold text that is not a valid manifest at all.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import blake3

from goodput_ckpt.format.manifest import seal_manifest

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK = 4096
F0 = "rank00000-00.0123456789ab.bin"
F1 = "rank00000-01.0123456789ab.bin"
#: The data files the tests create next to each manifest: name -> size (all zero bytes).
DATA_FILES = {F0: 8256, F1: 32}


def zero_hashes(size: int, chunk: int = CHUNK) -> list[str]:
    return [blake3.blake3(bytes(min(chunk, size - i))).hexdigest() for i in range(0, size, chunk)]


def base() -> dict:
    return {
        "format": "goodput-ckpt",
        "version": 1,
        "library_version": "0.1.0",
        "torch_version": "2.13.0+cpu",
        "created_at": "2026-01-01T00:00:00Z",
        "world_size": 1,
        "byte_order": "little",
        "hash": {"algorithm": "blake3", "chunk_size": CHUNK},
        "files": {name: {"size": size, "chunks": zero_hashes(size)} for name, size in DATA_FILES.items()},
        "items": {
            "w": {
                "kind": "tensor",
                "dtype": "float32",
                "shape": [16, 128],
                "requires_grad": False,
                "chunks": [{"offsets": [0, 0], "sizes": [16, 128], "file": F0, "offset": 0, "length": 8192}],
            },
            "step": {"kind": "object", "encoding": "torch.save", "file": F0, "offset": 8192, "length": 64},
            "b": {
                "kind": "tensor",
                "dtype": "int64",
                "shape": [4],
                "requires_grad": False,
                "chunks": [{"offsets": [0], "sizes": [4], "file": F1, "offset": 0, "length": 32}],
            },
        },
        "dcp": {"version": "1.0.0", "planner_data": {"w": ["w"], "step": ["step"], "b": ["b"]}, "storage_meta": None},
        "metadata": {},
    }


def rename_file(doc: dict, old: str, new: str) -> dict:
    """Move data file ``old`` to the name ``new`` everywhere in the manifest."""
    doc["files"] = {(new if k == old else k): v for k, v in doc["files"].items()}
    for it in doc["items"].values():
        for ref in it.get("chunks", [it]):
            if ref.get("file") == old:
                ref["file"] = new
    return doc


def w_chunk(doc: dict) -> dict:
    return doc["items"]["w"]["chunks"][0]


CORRUPT = "CorruptCheckpointError"
VERSION = "CheckpointError"  # version errors are the base class, with .version set


def cases() -> dict[str, tuple[object, str | None, str, str]]:
    """name -> (manifest: dict or raw bytes, parse error or None, read_metadata error, message)."""
    out: dict[str, tuple[object, str | None, str, str]] = {}

    def add(name, mutate, parse=CORRUPT, read=None, msg=""):
        doc = mutate(copy.deepcopy(base())) if callable(mutate) else mutate
        out[name] = (doc, parse, read or parse or CORRUPT, msg)

    def set_(path, value):
        def mutate(doc):
            *head, last = path
            d = doc
            for p in head:
                d = d[p]
            d[last] = value
            return doc

        return mutate

    def delete(path):
        def mutate(doc):
            *head, last = path
            d = doc
            for p in head:
                d = d[p]
            del d[last]
            return doc

        return mutate

    # -- file names: never read or write outside the location ---------------------------------
    for name, bad in {
        "path_dotdot": "../outside.bin",
        "path_dotdot_inner": "sub/../../outside.bin",
        "path_dotdot_only": "..",
        "path_absolute": "/etc/passwd",
        "path_absolute_dotdot": "/../../etc/shadow",
        "path_backslash": "..\\outside.bin",
        "path_backslash_inner": "sub\\file.bin",
        "path_drive_letter": "C:/Windows/win.ini",
        "path_drive_relative": "c:outside.bin",
        "path_nul": "rank00000-00.bin\u0000.txt",
        "path_empty": "",
        "path_dot": "./rank00000-00.0123456789ab.bin",
        "path_empty_component": "sub//file.bin",
        "path_trailing_slash": "sub/",
    }.items():
        add(name, lambda d, bad=bad: rename_file(d, F0, bad), msg="unsafe file name" if bad else "invalid file name")
    add("path_manifest_as_data", lambda d: rename_file(d, F0, "manifest.json"), msg="'manifest.json' is invalid")
    add("path_unlisted_item_file", lambda d: (w_chunk(d).update(file="../../etc/passwd"), d)[1], msg="does not list")
    add("path_unlisted_object_file", set_(["items", "step", "file"], "other.bin"), msg="does not list")
    add("path_not_string", set_(["items", "w", "chunks", 0, "file"], 7), msg="wrong type")
    # -- references (version 3): a base is one plain path component, never a way out -------------
    for name, bad in {
        "base_dotdot": "..",
        "base_dot": ".",
        "base_slash": "step_1/../..",
        "base_absolute": "/etc",
        "base_backslash": "..\\x",
        "base_empty": "",
        "base_not_string": 7,
        "base_long": "s" * 256,
    }.items():
        add(name, lambda d, bad=bad: (d.update(version=3), d["files"][F1].update(base=bad), d)[2], msg="'base'")
    add("base_in_v1", lambda d: (d["files"][F1].update(base="step_00000001"), d)[1], msg="needs version 3")
    # -- version and format --------------------------------------------------------------------
    add("version_4", set_(["version"], 4), parse=VERSION, msg="reads versions 1, 2, 3")
    add("version_0", set_(["version"], 0), parse=VERSION, msg="reads versions 1")
    add("version_string", set_(["version"], "1"), parse=VERSION, msg="reads versions 1")
    add("version_bool", set_(["version"], True), parse=VERSION, msg="reads versions 1")
    add("version_missing", delete(["version"]), parse=VERSION, msg="reads versions 1")
    add("version_huge_int", b'{"format":"goodput-ckpt","version":' + b"9" * 5000 + b"}", msg="not valid JSON")
    add("format_other", set_(["format"], "safetensors"), msg="is not a goodput-ckpt manifest")
    add("format_missing", delete(["format"]), msg="is not a goodput-ckpt manifest")
    add("top_level_list", b"[1, 2, 3]", msg="is not a goodput-ckpt manifest")
    add("top_level_null", b"null", msg="is not a goodput-ckpt manifest")
    add("byte_order_big", set_(["byte_order"], "big"), msg="byte_order")
    add("hash_algorithm_sha256", set_(["hash", "algorithm"], "sha256"), msg="hash algorithm")
    add("hash_not_object", set_(["hash"], [CHUNK]), msg="wrong type")
    # -- unknown kinds, dtypes, encodings ------------------------------------------------------
    add("kind_unknown", set_(["items", "w", "kind"], "sparse_tensor"), msg="unknown item kind 'sparse_tensor'")
    add("kind_missing", delete(["items", "w", "kind"]), msg="unknown item kind None")
    add("dtype_unknown", set_(["items", "w", "dtype"], "float128"), msg="unknown dtype 'float128'")
    add("dtype_torch_prefixed", set_(["items", "w", "dtype"], "torch.float32"), msg="unknown dtype")
    add("dtype_not_string", set_(["items", "w", "dtype"], 4), msg="wrong type")
    add("encoding_pickle", set_(["items", "step", "encoding"], "pickle"), msg="unknown object encoding 'pickle'")
    add("encoding_missing", delete(["items", "step", "encoding"]), msg="'encoding' is missing")
    # -- sizes and ranges ----------------------------------------------------------------------
    add("file_size_negative", set_(["files", F0, "size"], -1), msg="outside")
    add("file_size_absurd", set_(["files", F0, "size"], 1 << 60), msg="outside")
    add("file_size_float", set_(["files", F0, "size"], 8256.0), msg="must be an integer")
    add("file_size_string", set_(["files", F0, "size"], "8256"), msg="must be an integer")
    add("file_size_bool", set_(["files", F1, "size"], True), msg="must be an integer")

    def terabytes(d):
        # A self-consistent manifest that claims a 1 TiB tensor in a 1 TiB file: it parses; only
        # the file on disk (8256 bytes) gives it away. A reader must not allocate or read 1 TiB.
        tib = 1 << 40
        d["hash"]["chunk_size"] = 1 << 30
        d["files"][F0] = {"size": tib + 64, "chunks": ["0" * 64] * ((tib >> 30) + 1)}
        d["files"][F1]["chunks"] = zero_hashes(32, 1 << 30)
        d["items"]["w"]["shape"] = [1 << 38]
        d["items"]["w"]["chunks"] = [{"offsets": [0], "sizes": [1 << 38], "file": F0, "offset": 0, "length": tib}]
        d["items"]["step"]["offset"] = tib
        return d

    add("size_terabytes", terabytes, parse=None, read=CORRUPT, msg="but the manifest records 1099511627840")
    add(
        "file_size_mismatch",
        lambda d: (d["files"][F1].update(size=64), d)[1],
        parse=None,
        read=CORRUPT,
        msg="is 32 bytes but the manifest records 64",
    )
    add("chunk_size_tiny", set_(["hash", "chunk_size"], 16), msg="outside")
    add("chunk_size_huge", set_(["hash", "chunk_size"], 1 << 40), msg="outside")
    add("chunk_size_zero", set_(["hash", "chunk_size"], 0), msg="outside")
    add("offset_negative", set_(["items", "step", "offset"], -64), msg="outside")
    add("length_negative", set_(["items", "step", "length"], -1), msg="outside")
    add("range_past_end", set_(["items", "step", "offset"], 8256), msg="beyond the end")
    add(
        "range_absurd",
        lambda d: (d["items"]["step"].update(offset=1 << 49, length=1 << 49), d)[1],
        msg="beyond the end",
    )
    add("range_past_end_tensor", lambda d: (w_chunk(d).update(offset=128), d)[1], msg="beyond the end")
    # -- shapes and lengths --------------------------------------------------------------------
    add("shape_length_mismatch", lambda d: (w_chunk(d).update(length=4096), d)[1], msg="length 4096 != 8192")
    add("shape_box_outside", lambda d: (w_chunk(d).update(offsets=[8, 0]), d)[1], msg="exceeds the shape")
    add("shape_ndim_mismatch", lambda d: (w_chunk(d).update(offsets=[0]), d)[1], msg="do not match")
    add("shape_negative_dim", set_(["items", "w", "shape"], [-16, -128]), msg="invalid dimension")
    add("shape_float_dim", set_(["items", "w", "shape"], [16.0, 128]), msg="invalid dimension")
    add("shape_not_list", set_(["items", "w", "shape"], 2048), msg="must be a list")
    add("shape_too_many_dims", set_(["items", "w", "shape"], [1] * 65), msg="at most 64")
    add(
        "shape_absurd",
        lambda d: (d["items"]["w"].update(shape=[1 << 50, 1 << 50]), w_chunk(d).update(sizes=[1 << 50, 1 << 50]), d)[2],
        msg="length 8192 !=",
    )
    add("sizes_not_list", lambda d: (w_chunk(d).update(sizes=None), d)[1], msg="must be a list")
    add("chunks_not_list", set_(["items", "w", "chunks"], {"0": {}}), msg="wrong type")
    add("chunk_not_object", set_(["items", "w", "chunks"], ["rank00000-00"]), msg="is not an object")

    # -- chunks must tile the tensor; items must not share bytes -------------------------------
    def two_chunks(d, second_offsets, second_offset=4096):
        half = {"offsets": [0, 0], "sizes": [8, 128], "file": F0, "offset": 0, "length": 4096}
        d["items"]["w"]["chunks"] = [half, dict(half, offsets=second_offsets, offset=second_offset)]
        return d

    add("chunks_empty", set_(["items", "w", "chunks"], []), msg="hold 0 of its 2048 elements")
    add(
        "chunks_gap",
        lambda d: (d["items"]["w"]["chunks"][0].update(sizes=[8, 128], length=4096), d)[1],
        msg="hold 1024 of its 2048 elements",
    )
    add("chunks_overlap", lambda d: two_chunks(d, [4, 0]), msg="chunks at offsets [0, 0] and [4, 0] overlap")
    add("chunks_duplicate", lambda d: two_chunks(d, [0, 0]), msg="chunks at offsets [0, 0] and [0, 0] overlap")
    add("items_share_bytes", set_(["items", "step", "offset"], 8128), msg="items 'w' and 'step' overlap")
    add("chunks_share_bytes", lambda d: two_chunks(d, [8, 0], second_offset=0), msg="items 'w' and 'w' overlap")

    def overlap_past_empty(d):
        # An empty item between two that overlap must not hide the overlap.
        d["items"]["e"] = {
            "kind": "tensor",
            "dtype": "float32",
            "shape": [0],
            "requires_grad": False,
            "chunks": [{"offsets": [0], "sizes": [0], "file": F0, "offset": 4096, "length": 0}],
        }
        d["items"]["step"]["offset"] = 8128
        return d

    add("items_share_bytes_past_empty", overlap_past_empty, msg="items 'w' and 'step' overlap")

    # -- format v2 grids: checked on the compact form -------------------------------------------
    def grid(block, runs, version=2, keep_chunks=False):
        def mutate(d):
            d["version"] = version
            w = d["items"]["w"]
            if not keep_chunks:
                del w["chunks"]
            w["grid"] = {"block": block, "runs": runs} if block is not None else runs
            return d

        return mutate

    halves = [[1, 0, 1, 0], [1, 0, 1, 4096]]  # "w" as two [8, 128] cells in file 0, one after the other
    add("grid_overlap", grid([8, 128], [[1, 0, 1, 0], [1, 0, 1, 2048]]), msg="items 'w' and 'w' overlap")
    add("grid_past_file", grid([8, 128], [[1, 0, 1, 0], [1, 1, 1, 0]]), msg="lies beyond the end of")
    add("grid_overlaps_object", grid([8, 128], [[1, 0, 1, 0], [1, 0, 1, 4160]]), msg="items 'w' and 'step' overlap")
    add("grid_file_index", grid([8, 128], [[2, 1, 1, 0]]), msg="are not all among the 2 files")
    add("grid_file_step_zero", grid([8, 128], [[2, 0, 0, 0]]), msg="are not all among the 2 files")
    add("grid_block_outside", grid([32, 128], [[1, 0, 1, 0]]), msg="is not within the shape")
    add("grid_block_zero", grid([0, 128], halves), msg="is not within the shape")
    add("grid_runs_short", grid([8, 128], halves[:1]), msg="its runs hold 1 of the grid's 2 cells")
    add("grid_runs_long", grid([8, 128], [[3, 0, 1, 0]]), msg="3 cells, but 2 of the grid's 2 are left")
    add("grid_run_uneven", grid([10, 128], [[2, 0, 1, 0]]), msg="differ in size")
    add("grid_run_not_ints", grid([8, 128], [[1, 0, 1, 0], [1, 0, 1, "4096"]]), msg="must be 4 integers")
    add("grid_run_bool", grid([16, 128], [[True, 0, 1, 0]]), msg="must be 4 integers")
    add("grid_run_float", grid([16, 128], [[1, 0, 1.0, 0]]), msg="must be 4 integers")
    add("grid_unaligned", grid([8, 128], [[1, 0, 1, 0], [1, 0, 1, 4100]]), msg="is not a multiple of 64")
    add("grid_not_object", grid(None, [1, 2]), msg="must be an object")
    add("grid_and_chunks", grid([8, 128], halves, keep_chunks=True), msg="holds both 'grid' and 'chunks'")
    add("grid_in_v1", grid([8, 128], halves, version=1), msg="field 'chunks' is missing")
    add(
        "offset_unaligned",
        lambda d: (d["items"]["step"].update(offset=8193, length=63), d)[1],
        msg="byte offset 8193 is not a multiple of 64",
    )
    # -- hashes --------------------------------------------------------------------------------
    add("hash_count_short", lambda d: (d["files"][F0]["chunks"].pop(), d)[1], msg="2 chunk hashes for 8256 bytes")
    add(
        "hash_count_long",
        lambda d: (d["files"][F0]["chunks"].append("0" * 64), d)[1],
        msg="4 chunk hashes for 8256 bytes",
    )
    add("hash_count_empty", set_(["files", F1, "chunks"], []), msg="0 chunk hashes for 32 bytes")
    add("hash_not_hex", lambda d: (d["files"][F1]["chunks"].__setitem__(0, "z" * 64), d)[1], msg="64 lowercase hex")
    add("hash_uppercase", lambda d: (d["files"][F1]["chunks"].__setitem__(0, "A" * 64), d)[1], msg="64 lowercase hex")
    add("hash_short", lambda d: (d["files"][F1]["chunks"].__setitem__(0, "ab"), d)[1], msg="64 lowercase hex")
    add("hash_not_string", lambda d: (d["files"][F1]["chunks"].__setitem__(0, 0), d)[1], msg="64 lowercase hex")
    # (the digests are checked as one joined string: lengths that add up must still be refused one by one)
    add(
        "hash_long_and_short",
        lambda d: (d["files"][F0]["chunks"].__setitem__(slice(0, 2), ["a" * 63, "a" * 65]), d)[1],
        msg="64 lowercase hex",
    )
    add(
        "hash_non_ascii",
        lambda d: (d["files"][F1]["chunks"].__setitem__(0, "\u00e9" * 64), d)[1],
        msg="64 lowercase hex",
    )
    add("hash_nul", lambda d: (d["files"][F1]["chunks"].__setitem__(0, "\u0000" * 64), d)[1], msg="64 lowercase hex")
    add("hash_list", lambda d: (d["files"][F1]["chunks"].__setitem__(0, ["0" * 64]), d)[1], msg="64 lowercase hex")
    # -- structure -----------------------------------------------------------------------------
    add("files_not_object", set_(["files"], [F0, F1]), msg="wrong type")
    add("file_entry_not_object", set_(["files", F1], 32), msg="is invalid")
    add("items_not_object", set_(["items"], []), msg="wrong type")
    add("items_missing", delete(["items"]), msg="'items' is missing")
    add("item_not_object", set_(["items", "w"], "float32"), msg="is not an object")
    add("world_size_zero", set_(["world_size"], 0), msg="outside")
    add("world_size_missing", delete(["world_size"]), msg="'world_size' is missing")
    add("dcp_not_object", set_(["dcp"], []), msg="must be objects")
    add("metadata_not_object", set_(["metadata"], "x"), msg="must be objects")
    # dcp.planner_data is checked by parse_manifest itself, so verify and inspect refuse what
    # dcp.load refuses (issue 22 section 1, issue 16 items 4 and 13).
    add("planner_data_not_object", set_(["dcp", "planner_data"], [1, 2]), msg="planner_data")
    add("planner_data_bad_path", set_(["dcp", "planner_data", "w"], [["w"]]), msg="planner_data")
    add("planner_data_huge_index", set_(["dcp", "planner_data", "w"], ["w", 1 << 40]), msg="list index below 3")
    add("planner_data_bool_index", set_(["dcp", "planner_data", "w"], ["w", True]), msg="planner_data")
    add("planner_data_empty_path", set_(["dcp", "planner_data", "w"], []), msg="planner_data")
    add("dcp_version_not_string", set_(["dcp", "version"], 1), msg="'version' must be a string")
    add("storage_meta_not_object", set_(["dcp", "storage_meta"], [1]), msg="storage_meta")
    add("requires_grad_not_bool", set_(["items", "w", "requires_grad"], "yes"), msg="requires_grad")
    # NaN and Infinity are not JSON: json.dumps writes them bare, and a lenient parser accepts them.
    add("metadata_nan", set_(["metadata", "loss"], float("nan")), msg="NaN is not a JSON value")
    add("metadata_infinity", set_(["metadata", "loss"], float("-inf")), msg="-Infinity is not a JSON value")
    return out


def main() -> int:
    for name in os.listdir(HERE):
        if name.endswith(".json"):
            os.remove(os.path.join(HERE, name))
    expected = {}
    for name, (doc, parse, read, msg) in sorted(cases().items()):
        # Sealed like a real manifest, so each case reaches the check it is about.
        raw = doc if isinstance(doc, bytes) else seal_manifest(json.dumps(doc, indent=1).encode())
        with open(os.path.join(HERE, f"{name}.json"), "wb") as f:
            f.write(raw)
        expected[f"{name}.json"] = {"parse": parse, "read_metadata": read, "message": msg}
    with open(os.path.join(HERE, "valid.json"), "wb") as f:
        f.write(seal_manifest(json.dumps(base(), indent=1).encode()))
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump({"data_files": DATA_FILES, "cases": expected}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(expected)} hostile manifests, valid.json and expected.json to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
