"""Namespaces and mounts of the sandbox's fork server and its runs (stdlib only).

With root, the fork server calls `enter_root` once: its own mount and network namespaces, and a
chroot into a dir holding read-only bind mounts of the interpreter and system libraries, a
/dev/null and an empty /work. Each run then calls `enter_run`: new mount, network and IPC
namespaces and a size-capped tmpfs at /work owned by its uid. Every mount a run can reach is
nosuid (setuid bits and file capabilities do nothing there), and all but /dev/null nodev.
Without root a run calls `unshare_userns` instead. This module does not fork, set uids or
limits: `sandbox_zygote.py` does.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["enter_root", "enter_run", "unshare_userns"]

_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
_CLONE_NEWIPC = 0x08000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 1, 2, 4, 32
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _bind(src: str, dst: str, writable: bool = False) -> None:
    """Bind `src` at `dst`, nosuid (setuid bits and file capabilities do nothing there) and,
    unless `writable` (which is for device nodes), read-only and nodev. A bind mount takes
    these flags only on a remount."""
    _check(_libc.mount(src.encode(), dst.encode(), None, _MS_BIND | _MS_REC, None),
           f"bind {src}")
    flags = _MS_BIND | _MS_REMOUNT | _MS_NOSUID | (0 if writable else _MS_RDONLY | _MS_NODEV)
    _check(_libc.mount(None, dst.encode(), None, flags, None), f"remount {dst}")


def _system_dirs() -> list[str]:
    """Read-only dirs the interpreter needs: /usr, /lib*, /bin and the Python install."""
    dirs = [d for d in ("/usr", "/lib", "/lib64", "/bin") if os.path.exists(d)]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
        dirs.append(prefix)
    return dirs


def enter_root(root: str) -> None:
    """Isolate the zygote once: private mounts, no network, chroot into `root` holding only
    read-only system dirs, /dev/null and an empty /work."""
    dirs = _system_dirs()
    for d in dirs:
        if os.path.islink(d):
            os.makedirs(os.path.dirname(root + d), exist_ok=True)
            os.symlink(os.readlink(d), root + d)
        else:
            os.makedirs(root + d, exist_ok=True)
    os.makedirs(root + "/dev", exist_ok=True)
    open(root + "/dev/null", "w").close()
    os.makedirs(root + "/work", exist_ok=True)
    os.chmod(root, 0o755)
    _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET), "unshare")
    _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    for d in dirs:
        if not os.path.islink(d):
            _bind(d, root + d)
    _bind("/dev/null", root + "/dev/null", writable=True)
    os.chroot(root)
    os.chdir("/")


def enter_run(uid: int, disk_mb: int) -> None:
    """Move this run into new mount, network and IPC namespaces and into its own /work: a
    tmpfs of `disk_mb` that only `uid` may use."""
    _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC), "unshare")
    opts = f"size={disk_mb}m,mode=0700,uid={uid},gid={uid}".encode()
    _check(_libc.mount(b"tmpfs", b"/work", b"tmpfs", _MS_NOSUID | _MS_NODEV, opts),
           "mount tmpfs")
    os.chdir("/work")


def unshare_userns() -> bool:
    """Move this process into new user, network and IPC namespaces; False where the kernel
    refuses (unprivileged user namespaces off)."""
    return _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWIPC) == 0
