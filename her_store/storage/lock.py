"""The single-writer lock of a store: an flock on local disk, a fenced lease object on object storage.

A backend hands out the lock that suits it (:meth:`~her_store.storage.base.Backend.writer_lock`): :class:`FlockLock`
where the store is a local directory (the kernel lets the flock go when its holder dies, even by kill -9, so a dead
writer's lock is taken over without any guess), :class:`LeaseLock` on object storage (a lease object, renewed in the
background and before every commit, conditional PUTs fencing a writer that lost it).
"""

from __future__ import annotations

import abc
import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
import warnings
import weakref

from her_store.checks import check_number
from her_store.errors import CorruptStoreError, StoreLockedError
from her_store.forks import reset_in_child
from her_store.storage.base import Backend, WriterLock
from her_store.storage.files import open_beneath, pid_alive, write_all

__all__ = ["DEFAULT_LEASE_TTL", "FlockLock", "LeaseLock"]

DEFAULT_LEASE_TTL = 300.0  # seconds an object-storage writer lease lasts unless renewed
HOLDER_LIMIT = 1 << 16  # bytes a lock's record of its holder may hold


def _holder_text(raw: bytes | None) -> str:
    try:
        h = json.loads(raw or b"")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"]))
        text = f"pid {h['pid']} on host {h['host']} since {since}"
        return f"{text} (lease token {h['token']})" if "token" in h else text
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return "an unknown writer"


def _flocked(root: str, key: str) -> bool | None:
    """Whether a process holds the exclusive flock on the local file ``key`` (as a writer of the store does while it is
    open), seen in the kernel's table of locks without taking or touching the lock; None where that table cannot be
    read."""
    fd = open_beneath(root, key)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:  # "1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> 0 EOF"
            return any(p[1:3] == ["FLOCK", "ADVISORY"] and p[3] == "WRITE" and p[5] == where for p in map(str.split, f))
    except OSError:
        return None


def _token_of(raw: bytes | None) -> str | None:
    try:
        return json.loads(raw or b"")["token"]
    except (ValueError, KeyError, TypeError):
        return None


class _HeldLock(WriterLock):
    """A lock whose record in its key names the holder (pid, host, since, a unique token), forgotten in a forked
    child.

    Parameters
    ----------
    key : str
        The lock's key in the store (``writer.lock``).
    lease_ttl : float
        Seconds a lease lasts unless renewed (a positive, finite number; object storage only).
    """

    def __init__(self, key: str, lease_ttl: float = DEFAULT_LEASE_TTL) -> None:
        self.key = key
        self.lease_ttl = check_number(lease_ttl, "lease_ttl", low=0, low_open=True, finite=True)
        self._token: str = uuid.uuid4().hex  # also makes each writer's lease bytes, so their S3 ETag (an MD5), unique
        self._since = 0.0
        self._held = False
        self._pid = os.getpid()
        _LOCKS.add(self)
        reset_in_child(self)

    def _record(self, expires: float | None = None) -> bytes:
        return json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "token": self._token,
                "since": self._since,
                "expires": time.time() + self.lease_ttl if expires is None else expires,
            }
        ).encode()

    def after_fork(self) -> None:
        """In a child after fork: the lock is the parent's; the child neither holds nor releases it."""
        if self._pid != os.getpid():
            self._forked()

    @abc.abstractmethod
    def _forked(self) -> None:
        """Let go of what the child inherited of the parent's lock."""


class FlockLock(_HeldLock):
    """``flock`` on the lock file of a local store; the kernel drops it when the holder dies (even by kill -9), so the
    lock of a dead process is taken over without any staleness guess. The file names the holder.

    Examples
    --------
    >>> import tempfile
    >>> from her_store.storage import open_backend
    >>> lock = open_backend(tempfile.mkdtemp()).writer_lock("writer.lock", lease_ttl=30)
    >>> lock.acquire(); lock.ensure_held(); lock.release()
    """

    def __init__(self, backend: Backend, key: str, lease_ttl: float = DEFAULT_LEASE_TTL) -> None:
        super().__init__(key, lease_ttl)
        self.backend = backend
        self._fd: int | None = None

    def acquire(self) -> None:
        self._since = time.time()
        # never through a link: the record below truncates the file it opens
        fd = open_beneath(self.backend.root, self.key, create=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0)
            os.close(fd)
            raise StoreLockedError(
                f"{self.backend} is being written by {_holder_text(holder)}; one writer per store "
                "(open with mode='r' to read while it writes)"
            ) from None
        try:  # the record only names the holder; the flock is the lock, and dies with this fd
            os.ftruncate(fd, 0)
            write_all(fd, self._record(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._held = True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (unlinking would race a waiting opener)
            self._fd = None
        self._held = False

    def _forked(self) -> None:
        # the inherited descriptor is closed; the flock stays the parent's and goes when the parent's does
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._held = False

    @staticmethod
    def holder(backend: Backend, key: str) -> str | None:
        """Who holds the lock in ``key`` now, without taking or touching it: the holder its record names when that
        is a live process of this host, not this one, holding the file's flock (a writer that closed the store let
        it go); None when nobody is."""
        try:
            raw = backend.read_bytes(key, limit=HOLDER_LIMIT)
            h = json.loads(raw or b"")
            alive = h["host"] == socket.gethostname() and pid_alive(int(h["pid"])) and int(h["pid"]) != os.getpid()
            alive = alive and _flocked(backend.root, key) is not False
        except (ValueError, KeyError, TypeError, OverflowError, CorruptStoreError, OSError):
            return None
        return _holder_text(raw) if alive else None


class LeaseLock(_HeldLock):
    """A lease object on object storage naming its holder and a unique token.

    A fresh lease is created with a conditional PUT (If-None-Match: *). A daemon thread renews it every
    ``lease_ttl / 4`` seconds and :meth:`ensure_held` renews it before every commit, so a live writer keeps it however
    long it idles. A lease is stale when its holder is a dead process on this host or when ``expires`` has passed;
    another writer then takes it over. Where the store honours If-Match (S3), every lease write is fenced: a renewal
    or release names the ETag of our last write, a take-over the ETag of the stale lease it read, so a writer that was
    frozen past its TTL fails its next renewal and raises StoreLockedError before its commit writes a row. Stores
    that ignore If-Match (fsspec's memory://, possibly gcsfs) fall back to reading the lease and comparing its token
    before each write, and to delete + create for a take-over: correct unless two writers interleave within one round
    trip.

    Examples
    --------
    >>> from her_store.storage import open_backend
    >>> lock = open_backend("memory://leased").writer_lock("writer.lock", lease_ttl=30)
    >>> lock.acquire(); lock.ensure_held(); lock.release()
    """

    def __init__(self, backend: Backend, key: str, lease_ttl: float = DEFAULT_LEASE_TTL) -> None:
        super().__init__(key, lease_ttl)
        self.backend = backend
        self._etag: str | None = None  # of our last lease write; None where If-Match is not honoured
        self._lost: str | None = None  # why the lease is no longer ours
        self._mutex = threading.Lock()  # the renewal thread and a commit's check both write the lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease, then renew it in the background until released."""
        self._since = time.time()
        self._acquire_lease()
        self._held = True
        self._thread = threading.Thread(target=self._keep_renewing, name=f"her_store lease {self.backend}", daemon=True)
        self._thread.start()

    def _acquire_lease(self) -> None:
        backend = self.backend
        for _ in range(2):
            try:
                etag = backend.put(self.key, self._record(), create=True)
            except FileExistsError:
                raw, held_etag = self._read_lease()
                if raw is None:
                    continue  # released and removed since: create it again
                if not self._stale(raw):
                    raise StoreLockedError(
                        f"{backend} is being written by {_holder_text(raw)} (lease {self.key}); one writer per "
                        "store (open with mode='r' to read while it writes)"
                    ) from None
                if held_etag is None:
                    backend.remove(self.key)  # (another writer may have removed it first)
                    continue
                try:
                    # fails if the lease was renewed or taken over since it was read
                    etag = backend.put(self.key, self._record(), if_match=held_etag)
                except OSError:
                    continue
            self._etag = etag
            if self._etag is not None and not self._if_match_honoured():
                self._etag = None
            return
        raise StoreLockedError(f"{backend}: another writer took the stale lease {self.key} first")

    @property
    def fences_writes(self) -> bool:
        return self._etag is not None

    def _if_match_honoured(self) -> bool:
        """Whether the store refuses a PUT whose If-Match names an ETag the lease does not have. S3 does; a store
        that silently ignored it would make every fenced write unconditional, so that is checked, not assumed."""
        try:
            self.backend.put(self.key, self._record(), if_match='"her_store-if-match-probe"')
        except OSError:
            return True
        return False

    def _read_lease(self) -> tuple[bytes | None, str | None]:
        """The lease's bytes and an ETag of them (None where the store reports none); (None, None) if absent."""
        # the ETag first: the bytes read next are of that version or a newer one, so a write conditioned on this
        # ETag fails if what the bytes say is not what the lease still holds
        try:
            etag = self.backend.head(self.key)
        except FileNotFoundError:
            return None, None
        return self.backend.read_bytes(self.key), etag

    def _stale(self, raw: bytes | None) -> bool:
        try:
            h = json.loads(raw or b"")
            if h["host"] == socket.gethostname() and not pid_alive(int(h["pid"])):
                return True
            if h["host"] == socket.gethostname() and int(h["pid"]) == os.getpid():
                # this process's own lease: stale unless a handle here still holds it (a close whose release
                # failed leaves one behind, which must not lock this process out for lease_ttl)
                return not any(lock._held and lock._token == h.get("token") for lock in list(_LOCKS))
            return float(h["expires"]) < time.time()
        except (ValueError, KeyError, TypeError):
            return True

    def ensure_held(self) -> None:
        """Renew the lease, which proves it is still ours (one conditional PUT on S3)."""
        with self._mutex:
            self._renew()

    def _renew(self) -> None:
        """Extend the lease if it is still ours, else remember why not and raise StoreLockedError (holds _mutex)."""
        if self._lost is not None:
            raise StoreLockedError(self._lost)
        if self._etag is None:
            self._check_token(self.backend.read_bytes(self.key))
            self.backend.put(self.key, self._record())
            return
        try:
            etag = self.backend.put(self.key, self._record(), if_match=self._etag)
        except OSError:
            raw, held_etag = self._read_lease()
            self._check_token(raw)
            self._etag = held_etag  # still ours: the write failed in transit, or was applied and its reply lost
            raise
        self._etag = etag

    def _check_token(self, raw: bytes | None) -> None:
        if _token_of(raw) != self._token:
            self._lost = (
                f"{self.backend} lost its writer lease {self.key} to {_holder_text(raw)}, which found it not renewed "
                f"within lease_ttl={self.lease_ttl:g} s (this writer was suspended or cut off from the store, or the "
                "hosts' clocks disagree) and took it over; this handle commits nothing more (reopen with mode='a' to "
                "append after that writer's commits)"
            )
            raise StoreLockedError(self._lost)

    def _keep_renewing(self) -> None:
        while not self._stop.wait(self.lease_ttl / 4) and self._lost is None:
            # a lost lease sets _lost, which ends the loop; any other failure (a network hiccup) must not end
            # renewal: the next round retries, and the pre-commit check reports a failure that persists
            with self._mutex, contextlib.suppress(Exception):
                self._renew()

    def _forked(self) -> None:
        # the lease is the parent's: never renewed nor released from the child
        self._held = False
        self._thread = None

    def release(self) -> None:
        if not self._held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._held = False
        if self._lost is not None:
            return
        if self._etag is None:
            if _token_of(self.backend.read_bytes(self.key)) == self._token:
                self.backend.remove(self.key)
            return
        # an expired record rather than a delete: S3 ignores If-Match on DELETE, and a blind delete could remove a
        # lease another writer has just taken. If this write fails, the lease lapses after lease_ttl.
        try:
            self.backend.put(self.key, self._record(expires=0.0), if_match=self._etag)
        except OSError as e:  # closing goes on: the lease lapses by itself, and this process can take it back
            warnings.warn(
                f"{self.backend}: the writer lease {self.key} could not be released ({e}); other processes can take "
                f"it over after lease_ttl={self.lease_ttl:g} s",
                RuntimeWarning,
                stacklevel=2,
            )

    @staticmethod
    def holder(backend: Backend, key: str) -> str | None:
        """Who holds the lease in ``key`` now, without taking or touching it: its holder while it has not expired;
        None when nobody does."""
        try:
            raw = backend.read_bytes(key, limit=HOLDER_LIMIT)
            alive = float(json.loads(raw or b"")["expires"]) >= time.time()
        except (ValueError, KeyError, TypeError, OverflowError, CorruptStoreError, OSError):
            return None
        return _holder_text(raw) if alive else None


_LOCKS: weakref.WeakSet[_HeldLock] = weakref.WeakSet()
