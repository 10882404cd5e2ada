"""The daemon's listening socket and its talk with systemd, implemented directly (no dependency).

- Socket activation (sd_listen_fds): systemd passes the listening socket as fd 3 with
  LISTEN_PID = our pid and LISTEN_FDS >= 1; the socket file then belongs to systemd's .socket unit.
- Otherwise we bind the path ourselves: mode 0600 (0660 with a group), never over a live daemon's
  socket, replacing a stale one (a socket file nobody accepts on); removed at exit if still ours.
- Readiness (sd_notify): "READY=1", "STATUS=...", "STOPPING=1" as datagrams to $NOTIFY_SOCKET.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import socket
import stat
from dataclasses import dataclass

from fomoepy.errors import FomoeError

log = logging.getLogger("fomoe.serve")

SD_LISTEN_FDS_START = 3


def notify(*assignments: str) -> bool:
    """Send "KEY=value" lines to systemd's notify socket; False when not run under systemd (or it failed)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or address[0] not in "/@":
        return False
    if address[0] == "@":  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(assignments).encode(), address)
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", address.lstrip("\0"), e.strerror or e)
        return False
    return True


def inherited_socket() -> socket.socket | None:
    """The socket systemd passed (socket activation), or None. Clears LISTEN_* so children do not see them."""
    pid, fds = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)
    if not pid or not fds:
        return None
    try:
        if int(pid) != os.getpid():
            return None
        n = int(fds)
    except ValueError:
        raise FomoeError(f"bad socket activation variables LISTEN_PID={pid!r} LISTEN_FDS={fds!r}") from None
    if n < 1:
        return None
    if n > 1:
        log.warning("systemd passed %d sockets; using the first (fd %d)", n, SD_LISTEN_FDS_START)
    try:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    except OSError as e:
        raise FomoeError(f"socket activation: fd {SD_LISTEN_FDS_START} is not a usable socket ({e.strerror})") from None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise FomoeError(f"the socket systemd passed (fd 3) is not a Unix stream socket: {sock.family!r} {sock.type!r}")
    os.set_inheritable(sock.fileno(), False)
    sock.setblocking(False)
    return sock


def check_not_live(path: str) -> None:
    """FomoeError when a daemon already accepts on `path`, or `path` is something other than a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise FomoeError(f"cannot check socket path {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise FomoeError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: nobody accepts on it
    except OSError as e:
        if e.errno == errno.EAGAIN:  # listening, backlog full: alive
            raise FomoeError(f"a daemon is already listening on {path}") from None
        raise FomoeError(f"cannot check socket {path}: {e.strerror}") from None
    finally:
        probe.close()
    raise FomoeError(f"a daemon is already listening on {path}")


@dataclass
class Listener:
    sock: socket.socket
    path: str | None  # the socket file we created (None: systemd's)
    inode: int | None = None

    @property
    def description(self) -> str:
        return self.path if self.path is not None else "the socket passed by systemd"

    def remove_file(self) -> None:
        """Unlink our socket file, unless another daemon has replaced it meanwhile."""
        if self.path is None or self.inode is None:
            return
        try:
            if os.lstat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove %s: %s", self.path, e.strerror)
        self.inode = None


def bind_unix(path: str, group: str | None = None) -> Listener:
    """A listening socket at `path`, mode 0600, or 0660 owned by `group`; a stale socket file is replaced."""
    if len(os.fsencode(path)) > 107:
        raise FomoeError(f"socket path is too long for a Unix socket ({len(os.fsencode(path))} bytes > 107): {path}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FomoeError(f"cannot create socket {path}: directory {parent} does not exist (create it or pass --socket)")
    gid = None
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise FomoeError(f"--socket-group: no group named {group!r}") from None
    check_not_live(path)
    try:
        os.unlink(path)  # stale (checked above)
        log.info("removed stale socket %s", path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # the file gets mode 0777 & ~umask at bind: a tight umask leaves no moment where others can connect
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        raise FomoeError(f"cannot bind socket {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    listener = Listener(sock, path, os.lstat(path).st_ino)
    try:
        if gid is not None:
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
        sock.listen(128)
    except OSError as e:
        listener.remove_file()
        sock.close()
        raise FomoeError(f"cannot set up socket {path}: {e.strerror}") from None
    sock.setblocking(False)
    return listener
