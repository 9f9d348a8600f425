"""The first program inside a code sandbox: lock the process down, then exec the untrusted program.

Run as `python -I -S -c SOURCE_OF_THIS_FILE CONFIG_JSON PROGRAM [ARGS...]` (standard library only: it runs
before, and outside, any site-packages). First it makes itself undumpable: without a PID namespace it is the
program's parent, of the same user, and where no Landlock domain stands between them the program could otherwise
trace it or write its memory through /proc (stop it, so that step 5 never runs; or make it, which has no signal
filter, signal the hub). The program's exec makes the program itself dumpable again. Then, in order, it
0. in a mount namespace (entered with the capabilities `unshare --keep-caps` leaves it), mounts an empty
   read-only tmpfs over each of the host's shared directories it is given (/tmp, /run, /dev/shm, the hub's
   HOME: where Unix sockets, agents' and buses' among them, and other users' files live), binding the working
   directory back in place when it lies under one; then drops those capabilities, so the program has none,
1. sets the resource limits (CPU seconds, address space, file size, processes, open files, no core),
2. sets no_new_privs, so nothing it execs can gain privileges (and unprivileged filters are allowed),
3. applies Landlock when the kernel has it: reads and executes only under the configured read-only
   roots, writes only under the working directory, no TCP bind/connect (ABI >= 4), no signals or
   abstract-socket connections to processes outside the sandbox (ABI >= 6),
4. installs a seccomp filter (x86_64, aarch64): `socket()` (of every family: AF_UNIX too, or the program could
   connect to any Unix socket its user may reach, an SSH agent, a D-Bus bus, docker.sock; `socketpair()` stays),
   `io_uring` (which can open sockets too), leaving the process group (`setsid`, `setpgid`: so the parent's group
   kill reaches every descendant), memory no address-space limit counts (`memfd_create`, System V `shmget`:
   pages held without being mapped), and namespaces of its own (`unshare`, `setns`, `clone` with a CLONE_NEW* flag:
   in a user namespace of its own the program could mount a tmpfs where Landlock does not refuse mounts, files held
   in memory that neither an rlimit nor the hub's disk and memory watchdogs count) fail with EPERM; `clone3`, whose
   flags a filter cannot read, fails with ENOSYS, so that libc falls back to `clone`; syscalls of another ABI kill
   the process,
5. turns its parent's death into the death of its whole process group: the hub SIGKILLs a worker whose
   item overran, mid-run, and where no PID namespace ends the program with this process, nothing else
   would (the program and its children would live on under init),
6. forks PROGRAM and, where neither a PID namespace nor Landlock (ABI >= 6) keeps its signals in, adds a seccomp
   filter to it (it knows its own pid only once forked) that refuses every signal but those to itself and to its
   own process group: `kill`/`rt_sigqueueinfo` other than to its pid, 0 or its group, `tgkill`/`rt_tgsigqueueinfo`
   to another process, `tkill`, `pidfd_send_signal`, and SIGIO's route (`F_SETOWN`, `F_SETOWN_EX`, `FIOSETOWN`,
   `SIOCSPGRP`), and stop signals to anything; the program runs as the hub's user there, and `kill(-1, SIGKILL)`
   would otherwise end the hub. Without a PID namespace the program also goes into a Landlock domain nested in
   this process's, so that it can neither trace this process nor (ABI >= 6) signal it: stopped, it would not
   run step 5's group kill, and the program would outlive the worker,
7. waits for PROGRAM, reaping orphans meanwhile (it is PID 1 of a fresh PID namespace
   when the platform gives one), then exits with the program's code, or 128 + N when signal N
   ended it.
Any step the kernel refuses is fatal (exit 125): a sandbox that is weaker than asked never runs code.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys

SETUP_FAILED = 125

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_HIDING_TMPFS = b"size=64k,mode=755"
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2

_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_ABI1_ALL = (1 << 13) - 1
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

# (audit arch, socket, setsid, setpgid, io_uring_setup, memfd_create, shmget, unshare, setns) per machine.
_SYSCALLS = {
    "x86_64": (0xC000003E, 41, 112, 109, 425, 319, 29, 272, 308),
    "aarch64": (0xC00000B7, 198, 157, 154, 425, 279, 194, 97, 268),
}
# (clone, clone3) per machine: clone's flags are its first argument; clone3's are in memory, out of a filter's reach.
_CLONE_SYSCALLS = {"x86_64": (56, 435), "aarch64": (220, 435)}
# CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET.
_CLONE_NEW_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
# (kill, rt_sigqueueinfo, tgkill, rt_tgsigqueueinfo, tkill, pidfd_send_signal, fcntl, ioctl) per machine.
_SIGNAL_SYSCALLS = {
    "x86_64": (62, 129, 234, 297, 200, 424, 72, 16),
    "aarch64": (129, 138, 131, 240, 130, 424, 25, 29),
}
_X32_SYSCALL_BIT = 0x40000000
_EPERM = 1
_F_SETOWN, _F_SETOWN_EX, _FIOSETOWN, _SIOCSPGRP = 8, 15, 0x8901, 0x8902
_FIRST_SIGNAL_SCOPING_ABI = 6
_STOP_SIGNALS = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
_FS_MAKE_BLOCK = 1 << 11
_ENOSYS = 38
_BPF_LOAD, _BPF_JEQ, _BPF_JGE, _BPF_JSET, _BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _DENY, _KILL = 0x7FFF0000, 0x00050000 | _EPERM, 0x80000000
_NOT_IMPLEMENTED = 0x00050000 | _ENOSYS


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _check(result: int, what: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return result


def set_limits(limits: dict[str, int]) -> None:
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def landlock_abi(libc: ctypes.CDLL) -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is absent or disabled."""
    version = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), _LANDLOCK_CREATE_RULESET_VERSION)
    return max(0, version)


def apply_landlock(libc: ctypes.CDLL, abi: int, read_roots: list[str], write_root: str) -> None:
    handled_fs = _FS_ABI1_ALL | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    handled_fs |= _FS_IOCTL_DEV if abi >= 5 else 0
    handled_net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = _RulesetAttr(handled_fs, handled_net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    created = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    ruleset = _check(created, "landlock_create_ruleset")
    read_only = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    file_rights = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
    rules = [(root, read_only) for root in read_roots] + [(write_root, handled_fs)]
    rules += [(device, _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE) for device in ("/dev/null", "/dev/zero")]
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        if not os.path.isdir(path):
            rights &= file_rights
        rule = _PathBeneath(rights & handled_fs, fd)
        added = libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0)
        _check(added, f"landlock_add_rule {path}")
        os.close(fd)
    _check(libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)


def _bpf(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def seccomp_program(machine: str) -> bytes | None:
    """The filter described in the module docstring, for `machine`; None when it is not supported."""
    if machine not in _SYSCALLS:
        return None
    arch, *refused = _SYSCALLS[machine]
    clone, clone3 = _CLONE_SYSCALLS[machine]
    load, jeq, jge, jset, ret = _BPF_LOAD, _BPF_JEQ, _BPF_JGE, _BPF_JSET, _BPF_RET
    n = len(refused)
    return b"".join([
        _bpf(load, 0, 0, 4),                                   # arch
        _bpf(jeq, 1, 0, arch),                                 # our ABI -> the syscall number
        _bpf(ret, 0, 0, _KILL),
        _bpf(load, 0, 0, 0),                                   # the syscall number
        _bpf(jge, n + 3, 0, _X32_SYSCALL_BIT),                 # x32 ABI -> deny
        *(_bpf(jeq, n + 2 - i, 0, number) for i, number in enumerate(refused)),  # -> deny
        _bpf(jeq, 4, 0, clone),                                # -> clone's flags
        _bpf(jeq, 2, 0, clone3),                               # -> not implemented
        _bpf(ret, 0, 0, _ALLOW),
        _bpf(ret, 0, 0, _DENY),
        _bpf(ret, 0, 0, _NOT_IMPLEMENTED),
        _bpf(load, 0, 0, 16),                                  # clone's flags (the low half of argument 0)
        _bpf(jset, 0, 1, _CLONE_NEW_NAMESPACES),               # a namespace flag -> deny
        _bpf(ret, 0, 0, _DENY),
        _bpf(ret, 0, 0, _ALLOW),
    ])  # fmt: skip


def signal_seccomp_program(machine: str, pid: int, pgid: int) -> bytes | None:
    """The filter of step 6 for the program `pid` in process group `pgid`; None when `machine` is not supported.

    Each rule is (syscall, argument, values, whether the values are the only ones allowed or the ones refused);
    the kernel reads a pid (an int) from the low 32 bits of its argument, so that is what the filter compares."""
    if machine not in _SIGNAL_SYSCALLS:
        return None
    kill, sigqueue, tgkill, tgsigqueue, tkill, pidfd_send_signal, fcntl, ioctl = _SIGNAL_SYSCALLS[machine]
    own = (pid, 0, -pgid & 0xFFFFFFFF)  # itself, its group, its group by id
    rules: list[tuple[int, int, tuple[int, ...], bool]] = [
        (kill, 0, own, True),
        (sigqueue, 0, own, True),
        (tgkill, 0, (pid,), True),
        (tgsigqueue, 0, (pid,), True),
        (tkill, 0, (), True),
        (pidfd_send_signal, 0, (), True),
        (fcntl, 1, (_F_SETOWN, _F_SETOWN_EX), False),
        (ioctl, 1, (_FIOSETOWN, _SIOCSPGRP), False),
    ]
    blocks = []
    for syscall, argument, values, only_these in rules:
        match, other = (_ALLOW, _DENY) if only_these else (_DENY, _ALLOW)
        tests = [_bpf(_BPF_JEQ, len(values) - i, 0, value) for i, value in enumerate(values)]
        block = [_bpf(_BPF_LOAD, 0, 0, 16 + 8 * argument), *tests, _bpf(_BPF_RET, 0, 0, other),
                 _bpf(_BPF_RET, 0, 0, match)]  # fmt: skip
        if syscall in (kill, sigqueue):
            # The group holds the sandbox's first process, which must stay able to run: no stop signal (argument 1)
            # to anything, each test jumping to the block's refusal past the other stop tests and the pid tests.
            stops = [_bpf(_BPF_JEQ, len(_STOP_SIGNALS) - 1 - i + len(block) - 2, 0, number)
                     for i, number in enumerate(_STOP_SIGNALS)]  # fmt: skip
            block = [_bpf(_BPF_LOAD, 0, 0, 16 + 8 * 1), *stops, *block]
        blocks.append(block)
    head = [_bpf(_BPF_LOAD, 0, 0, 4), _bpf(_BPF_JEQ, 1, 0, _SYSCALLS[machine][0]), _bpf(_BPF_RET, 0, 0, _KILL),
            _bpf(_BPF_LOAD, 0, 0, 0)]  # fmt: skip
    # After the dispatch: one jump per rule, then "allow"; rule i's block starts `starts[i]` past the allow.
    starts = [sum(len(block) for block in blocks[:i]) for i in range(len(blocks))]
    dispatch = [_bpf(_BPF_JEQ, len(rules) - i + starts[i], 0, rule[0]) for i, rule in enumerate(rules)]
    program = [*head, *dispatch, _bpf(_BPF_RET, 0, 0, _ALLOW), *(line for block in blocks for line in block)]
    return b"".join(program)


def apply_seccomp(libc: ctypes.CDLL, program: bytes) -> None:
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buffer))
    _check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def _mount(
    libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int, data: bytes | None
) -> None:
    encoded = [None if text is None else text.encode() for text in (source, target, fstype)]
    _check(libc.mount(*encoded, ctypes.c_ulong(flags), data), f"mount {target}")


def hide_host_directories(libc: ctypes.CDLL, directories: list[str]) -> None:
    """Step 0; `directories` are real paths, none inside another."""
    workdir = os.getcwd()
    work = os.open(workdir, os.O_PATH | os.O_CLOEXEC)
    hidden = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    for directory in directories:
        _mount(libc, "tmpfs", directory, "tmpfs", hidden, _HIDING_TMPFS)
        if workdir.startswith(directory.rstrip("/") + "/"):
            os.makedirs(workdir)
            _mount(libc, f"/proc/self/fd/{work}", workdir, None, _MS_BIND, None)
        _mount(libc, None, directory, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | hidden, None)
    os.close(work)
    os.chdir(workdir)  # into the bind mount, where the program's paths lead
    _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "dropping capabilities")


def lock_down(config: dict) -> int:
    """Steps 0 to 4; returns the Landlock ABI applied (0: none)."""
    libc = ctypes.CDLL(None, use_errno=True)
    abi = 0
    if config["namespaces"]:
        hide_host_directories(libc, config["hide"])
    set_limits(config["limits"])
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if config["landlock"]:
        abi = landlock_abi(libc)
        if abi == 0:
            raise OSError("Landlock was required but the kernel does not offer it")
        apply_landlock(libc, abi, config["read_roots"], os.getcwd())
    if config["seccomp"]:
        program = seccomp_program(platform.machine())
        if program is None:
            raise OSError(f"seccomp was required but {platform.machine()} is not supported")
        apply_seccomp(libc, program)
    return abi


def apply_nested_domain(libc: ctypes.CDLL, abi: int) -> None:
    """A Landlock domain inside the sandbox's, for the program alone: Landlock lets no process ptrace, nor from ABI 6
    signal, one of an enclosing domain, which this process's parent now is. The domain handles only making block
    devices, which needs a capability the program lacks anyway, so it takes away nothing else."""
    scoped = _SCOPE_SIGNAL if abi >= _FIRST_SIGNAL_SCOPING_ABI else 0
    attr = _RulesetAttr(_FS_MAKE_BLOCK, 0, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _check(libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0),
                     "landlock_create_ruleset (nested)")  # fmt: skip
    _check(libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self (nested)")
    os.close(ruleset)


def confine_signals(config: dict, landlock: int) -> None:
    """Step 6, in the program's process before exec. Without a PID namespace, this process's parent is what kills
    the group when the hub's worker dies (step 5): stopped (SIGSTOP) or traced, it never would, and the program would
    outlive the worker. So the program goes into a Landlock domain nested in its parent's, and where Landlock does not
    scope signals, a seccomp filter keeps them to itself and its group, with no stop signal at all."""
    if config["namespaces"]:
        return  # the parent is the namespace's init, which no signal from inside stops, and dies with `unshare`
    libc = ctypes.CDLL(None, use_errno=True)
    if landlock:
        apply_nested_domain(libc, landlock)
    if not config["seccomp"] or landlock >= _FIRST_SIGNAL_SCOPING_ABI:
        return
    program = signal_seccomp_program(platform.machine(), os.getpid(), os.getpgid(0))
    if program is None:
        raise OSError(f"seccomp was required but {platform.machine()} is not supported")
    apply_seccomp(libc, program)


def _kill_group(signum: int, frame: object) -> None:
    os.killpg(0, signal.SIGKILL)
    os._exit(128 + signal.SIGKILL)  # the first process of a PID namespace does not get its own SIGKILL


def die_with_group_on_parent_death(libc: ctypes.CDLL) -> None:
    """The parent's death signal, SIGKILL until now (set before exec), becomes a SIGTERM that kills the group.

    The switch is one prctl, so a parent that dies at any moment still ends this process."""
    signal.signal(signal.SIGTERM, _kill_group)
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "parent death signal")


def main(argv: list[str]) -> None:
    config = json.loads(argv[1])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "making the sandbox's first process undumpable")
        landlock = lock_down(config)
        die_with_group_on_parent_death(libc)
    except OSError as exc:
        sys.stderr.write(f"sandbox setup failed: {exc}\n")
        os._exit(SETUP_FAILED)
    program = os.fork()
    if program == 0:
        try:
            confine_signals(config, landlock)
            os.execv(argv[2], argv[2:])
        except OSError as exc:
            sys.stderr.write(f"cannot start {argv[2]}: {exc}\n")
        os._exit(SETUP_FAILED)
    while True:
        pid, status = os.wait()
        if pid == program:
            break
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main(sys.argv)
