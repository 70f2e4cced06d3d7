"""Which S3 requests an incremental save makes that a save of the trainable state alone does not.

Issue 40: ``bench_incremental.py --s3`` counts an incremental LoRA save's requests from the
server's metrics (12 against 11 on a run's fourth save). This probe names them: it logs every
boto3 API call (operation and key) of saves 4 to 7 of each manager on a SeaweedFS server on
127.0.0.1 (the tests' recipe), lists the fourth save's calls and counts the others. Found
(2026-12-07): the extra call is a ``GetObject`` of the base step's commit record, which retention
reads once to learn whether the base references a step it would delete; later saves find it
remembered and make as many requests as the trainable state alone. Since issue 37's request
cuts (docs/s3.md, *Requests per save*; same day, later): 7 for the fourth incremental save, 6 for
every later one and for the trainable state alone (11 before): the listing of the step before the
save, the data and the commit ``PutObject``, the root's listing and the retired step's two deletes.
Since a manager's step writers skip that listing (2026-12-08): 6 and 5, the minimum.

Run: ``.venv/bin/python benchmarks/probe_incremental_requests.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import botocore.client
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the SeaweedFS recipe
import bench_incremental as bench  # noqa: E402
from helpers.s3 import SeaweedServer, s3_env  # noqa: E402

from goodput_ckpt import CheckpointManager  # noqa: E402

warnings.filterwarnings("ignore")
calls: list[tuple[str, str]] = []
_api_call = botocore.client.BaseClient._make_api_call


def _logged(self, operation, params):
    calls.append((operation, params.get("Key") or params.get("Prefix") or ""))
    return _api_call(self, operation, params)


def main() -> None:
    botocore.client.BaseClient._make_api_call = _logged
    os.environ.update(s3_env())
    scratch = Path(tempfile.mkdtemp(prefix="probe-incremental-"))
    server = SeaweedServer(scratch / "weed")
    try:
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3", endpoint_url=server.url, region_name="us-east-1", config=Config(s3={"addressing_style": "path"})
        )
        client.create_bucket(Bucket="bench")
        options = {"endpoint_url": server.url, "addressing_style": "path", "region": "us-east-1"}
        model, trainable = bench.lora_model(2, 128)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for name, module, incremental in (("incremental", model, True), ("trainable", trainable, False)):
            manager = CheckpointManager(
                f"s3://bench/{name}", keep_last=2, async_save=False, incremental=incremental, timeline=False, **options
            )
            for step in range(1, 8):
                bench.train_steps(model, opt, 1, step)
                calls.clear()
                manager.save(step, model=module, optimizer=opt)
                if step >= 4:
                    print(f"{name} save {step}: {len(calls)} requests")
                if step == 4:
                    for operation, key in calls:
                        print(f"    {operation} {key}")
            manager.close()
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
