"""The seccomp-BPF filter and `no_new_privs` of every sandbox run (stdlib only).

`sandbox_zygote.py` builds the filter once (`build`) and each run installs it (`install`) as the
last step before the program starts, after its namespaces, mounts and uid are in place. The
filter answers EPERM to the system calls that reach past the sandbox's walls or into the kernel's
rarely audited corners (ptrace, mounting and the new mount API, namespaces: unshare, setns and
clone with any CLONE_NEW* flag, keyrings, bpf, perf events, userfaultfd, io_uring, kernel modules,
kexec, chroot, file handles, another process's memory); clone3 gets ENOSYS, its flags being
out of a classic filter's reach, so libc falls back to clone, where they are checked. A call made
under another ABI (i386, x32) kills the process. Everything else is allowed: this is a deny list
over Python's needs (threads, subprocess, fork), not an allow list.

It knows the x86_64 and aarch64 syscall tables; elsewhere `build` returns None with the reason
and runs get `no_new_privs` without a filter. This is not the sandbox's only wall: a run is also
unprivileged, chrooted and in its own namespaces (see `sandbox.py`).
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

__all__ = ["Filter", "build", "install", "no_new_privs"]

_PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS, _SECCOMP_MODE_FILTER = 22, 38, 2
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF opcodes, with BPF_K
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (little-endian: arg0's low word)
_CLONE_NEW = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
              | 0x40000000)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_X32_BIT = 0x40000000

# name: (x86_64, aarch64); calls numbered 424 and up are the same on every arch
_DENY = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "unshare": (272, 97), "setns": (308, 268),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
}
_CLONE, _CLONE3 = (56, 220), (435, 435)
_ARCHES = {"x86_64": (0, 0xC000003E), "amd64": (0, 0xC000003E),  # (table column, AUDIT_ARCH_*)
           "aarch64": (1, 0xC00000B7), "arm64": (1, 0xC00000B7)}
_libc = ctypes.CDLL(None, use_errno=True)


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Filter:
    """A built filter: the BPF program and the ctypes objects that keep it alive."""

    def __init__(self, code: bytes) -> None:
        self.code = ctypes.create_string_buffer(code, len(code))
        self.prog = _Program(len(code) // 8, ctypes.addressof(self.code))


def build(machine: str | None = None) -> tuple[Filter | None, str]:
    """The filter for `machine` (default: this one) and a one-line description of it.

    Returns (None, reason) on an architecture whose syscall table this module does not know.
    """
    machine = (machine or platform.machine()).lower()
    if machine not in _ARCHES:
        return None, f"no seccomp filter: unknown architecture {machine!r}"
    col, audit_arch = _ARCHES[machine]
    special = sorted([(nrs[col], "eperm") for nrs in _DENY.values()]
                     + [(_CLONE3[col], "enosys"), (_CLONE[col], "clone")])
    prog: list[_Op] = [(_LD_ABS_W, 0, 0, _ARCH), (_JEQ, 0, "kill", audit_arch),
                       (_LD_ABS_W, 0, 0, _NR)]
    if col == 0:  # x32 calls carry AUDIT_ARCH_X86_64 too; they are told apart by this bit
        prog.append((_JGE, "kill", 0, _X32_BIT))
    prog += _search(special)
    prog += ["clone", (_LD_ABS_W, 0, 0, _ARG0), (_JSET, "eperm", 0, _CLONE_NEW),
             "allow", (_RET, 0, 0, _RET_ALLOW),
             "eperm", (_RET, 0, 0, _RET_ERRNO | errno.EPERM),
             "enosys", (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS),
             "kill", (_RET, 0, 0, _RET_KILL_PROCESS)]
    return Filter(_assemble(prog)), f"seccomp: {len(special)} calls filtered ({machine})"


_Op = tuple[int, int | str, int | str, int] | str  # (code, jt, jf, k) or a label


def _search(special: list[tuple[int, str]]) -> list[_Op]:
    """A binary search over the sorted (syscall, label) pairs, jumping to each one's label and
    returning ALLOW for any other call: a few comparisons per call, not one per pair."""
    if len(special) <= 3:
        leaf: list[_Op] = [(_JEQ, label, 0, nr) for nr, label in special]
        return [*leaf, (_RET, 0, 0, _RET_ALLOW)]
    mid = len(special) // 2
    upper = f"ge{special[mid][0]}"
    return [(_JGE, upper, 0, special[mid][0]), *_search(special[:mid]), upper,
            *_search(special[mid:])]


def _assemble(prog: list[_Op]) -> bytes:
    """Classic BPF bytes of `prog`, its jumps to labels resolved (all jumps go forward)."""
    at: dict[str, int] = {}
    ops: list[tuple[int, int | str, int | str, int]] = []
    for op in prog:
        if isinstance(op, str):
            at[op] = len(ops)
        else:
            ops.append(op)

    def jump(i: int, to: int | str) -> int:
        return to if isinstance(to, int) else at[to] - i - 1

    return b"".join(struct.pack("=HBBI", code, jump(i, jt), jump(i, jf), k)
                    for i, (code, jt, jf, k) in enumerate(ops))


def no_new_privs() -> None:
    """Set `no_new_privs`: nothing this process or its children exec gains privileges (setuid
    bits and file capabilities are ignored), and it may install a filter without root."""
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def install(flt: Filter | None) -> None:
    """Set `no_new_privs` and install `flt` (None: only the former) on this process; inherited
    by every thread and child it starts, and never removable."""
    no_new_privs()
    if flt is not None and _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                                       ctypes.byref(flt.prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
