"""Memory bound of the streaming tools on a 1 GiB checkpoint.

Each tool runs in a fresh process that samples its resident memory (``/proc/self/statm``, every
5 ms) from after the imports to the end; the peak above the starting point must stay far below
the input size. The
input is 16 tensors of 64 MiB plus small ones, so a tool that held the model, or even a
quarter of it, would fail. The bound is generous (384 MiB) so that a busy machine does not
make the test flaky.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

GIB = 1 << 30
BOUND = 384 << 20

_MAKE = """
import warnings, torch, torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
from goodput_ckpt import CheckpointWriter
sd = {"model": {f"layer{i}.weight": torch.arange(16 << 20, dtype=torch.float32).add_(i).view(4096, 4096) for i in range(16)}}
sd["model"]["bias"] = torch.ones(4096)
sd["step"] = 5
dcp.save(sd, storage_writer=CheckpointWriter(PATH))
"""

_RUN = """
import json, os, threading, warnings
warnings.filterwarnings("ignore")
import torch
from goodput_ckpt.tools.ops.convert import convert_checkpoint
from goodput_ckpt.tools.ops.reshard import reshard_checkpoint
from goodput_ckpt.tools.ops.verify import verify_checkpoint
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
base = peak = rss()
stop = threading.Event()
def sample():
    global peak
    while not stop.wait(0.005):
        peak = max(peak, rss())
t = threading.Thread(target=sample, daemon=True)
t.start()
OP
stop.set()
t.join()
print(json.dumps({"base": base, "peak": max(peak, rss())}))
"""


def _python(code: str) -> str:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


def _peak(op: str) -> int:
    doc = json.loads(_python(_RUN.replace("OP", op)).strip().splitlines()[-1])
    return doc["peak"] - doc["base"]


@pytest.mark.slow
def test_streaming_tools_stay_bounded_on_1gib(tmp_path):
    src = tmp_path / "src"
    _python(_MAKE.replace("PATH", repr(str(src))))
    size = sum(f.stat().st_size for f in src.iterdir())
    assert size >= GIB
    s = str(src)
    ops = {
        "verify": f"assert verify_checkpoint({s!r}).ok",
        "reshard": f"reshard_checkpoint({s!r}, {str(tmp_path / 'w2')!r}, world_size=2)",
        "to safetensors": f"convert_checkpoint({s!r}, {str(tmp_path / 'm.safetensors')!r}, to='safetensors')",
        "from safetensors": f"convert_checkpoint({str(tmp_path / 'm.safetensors')!r}, {str(tmp_path / 'g1')!r}, to='goodput')",
        "to torch": f"convert_checkpoint({s!r}, {str(tmp_path / 'm.pt')!r}, to='torch')",
        "from torch": f"convert_checkpoint({str(tmp_path / 'm.pt')!r}, {str(tmp_path / 'g2')!r}, to='goodput')",
        "to dcp": f"convert_checkpoint({s!r}, {str(tmp_path / 'd')!r}, to='dcp')",
        "from dcp": f"convert_checkpoint({str(tmp_path / 'd')!r}, {str(tmp_path / 'g3')!r}, to='goodput')",
    }
    peaks = {}
    for name, op in ops.items():
        peaks[name] = _peak(op)
        for done in ("w2", "g1", "g2", "g3"):
            shutil.rmtree(tmp_path / done, ignore_errors=True)
    over = {k: v >> 20 for k, v in peaks.items() if v > BOUND}
    assert not over, (
        f"peak memory above imports, MiB (bound {BOUND >> 20}): {over}; all: { {k: v >> 20 for k, v in peaks.items()} }"
    )
