"""Objects as files: what the object store keeps on disk, and how a write becomes durable.

A bucket is a directory; a key's segments (split on "/") are directories `d<segment>` and
its last segment the file `o<segment>` (segments percent-encoded, so no key can name a
path outside its bucket, and a key may be both an object and a prefix of others). A file
is a small JSON header (ETag, size, time, the headers kept from the PUT) and the body.

Every write goes to a temporary file that is fsync'd, then renamed over the object, then
the directory is fsync'd: a reader sees the old object or the new one, and what a PUT
answered survives a crash. A conditional write (If-None-Match: *, If-Match: <etag>) checks
and renames under the key's lock, so two writers of one key cannot both win.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import threading
import time
import uuid
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote

HEADER = struct.Struct(">I")  # the JSON header's length, before it
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._=-")
_LOCKS = 64
_REMEMBERED = 500_000  # objects' meta kept in memory for listings (~300 bytes each)
_REMEMBERED_DIRS = 20_000  # directories whose entries are kept in memory


class Precondition(Exception):
    """If-Match or If-None-Match did not hold."""


class NoSuchBucket(Exception):
    pass


class InvalidKey(Exception):
    pass


class StoreBusy(Exception):
    pass


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    etag: str  # quoted, as S3 sends it: '"<md5 hex>"'
    size: int
    mtime: float
    headers: dict[str, str] = field(default_factory=dict)  # Content-Type, x-amz-meta-*, ...


def encode_segment(segment: str) -> str:
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in segment.encode())


def decode_segment(name: str) -> str:
    return unquote(name, errors="strict") if "%" in name else name


Child = tuple[str, str, bool]  # (segment, "/"-ended for a directory; file name; directory?)


def _child(name: str) -> Child:
    is_dir = name[:1] == "d"
    return decode_segment(name[1:]) + ("/" if is_dir else ""), name, is_dir


def same_etag(a: str, b: str) -> bool:
    return a.strip().strip('"') == b.strip().strip('"')


class ObjectFiles:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.buckets = root / "buckets"
        self.tmp = root / "tmp"
        self._locks = [threading.Lock() for _ in range(_LOCKS)]
        self._metas: dict[tuple[str, str], ObjectMeta] = {}  # see `listed`
        self._dirs: dict[Path, list[Child]] = {}  # see `_children`
        self._listing = threading.Lock()
        for directory in (self.buckets, self.tmp):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One process per directory: the key locks are this process's own.
        self._held = open(root / "lock", "a")  # held while this process lives
        try:
            fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._held.close()
            raise StoreBusy(f"another object store serves {root}") from None
        for leftover in self.tmp.iterdir():  # writes a crash interrupted
            leftover.unlink()

    def create_bucket(self, bucket: str) -> None:
        self._ensure_dir(self._bucket(bucket, must_exist=False))

    def bucket_exists(self, bucket: str) -> bool:
        return self._bucket(bucket, must_exist=False).is_dir()

    # -- objects ----------------------------------------------------------------------------

    def put(
        self,
        bucket: str,
        key: str,
        body: bytes,
        headers: dict[str, str],
        if_match: str | None = None,
        if_none_match: str | None = None,
    ) -> ObjectMeta:
        path = self._path(bucket, key)
        meta = ObjectMeta(
            key, f'"{hashlib.md5(body).hexdigest()}"', len(body), time.time(), headers
        )
        tmp = self.tmp / f".{uuid.uuid4().hex}"
        header = json.dumps(
            {"etag": meta.etag, "size": meta.size, "mtime": meta.mtime, "headers": headers}
        ).encode()
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(len(header)) + header + body)
            f.flush()
            os.fsync(f.fileno())
        try:
            with self._lock(bucket, key):
                current = self._read_meta(path, key)
                if if_none_match is not None and current is not None:
                    raise Precondition(f"{key} exists")
                if if_match is not None and (
                    current is None or not same_etag(current.etag, if_match)
                ):
                    raise Precondition(f"{key} is not at {if_match}")
                self._ensure_dir(path.parent)
                os.replace(tmp, path)
                self._fsync_dir(path.parent)
                self._remember((bucket, key), meta)
                if current is None:
                    self._added(path.parent, path.name)
        finally:
            tmp.unlink(missing_ok=True)
        return meta

    def head(self, bucket: str, key: str) -> ObjectMeta | None:
        return self._read_meta(self._path(bucket, key), key)

    def listed(self, bucket: str, key: str) -> ObjectMeta | None:
        """`head`, from memory when this process has read or written it already: the broker
        lists a partition's every record batch on each fetch. Exact, as every write goes
        through this process (the lock file) and updates it under the key's lock."""
        if (meta := self._metas.get((bucket, key))) is not None:
            return meta
        with self._lock(bucket, key):
            meta = self.head(bucket, key)
            if meta is not None:
                self._remember((bucket, key), meta)
            return meta

    def get(self, bucket: str, key: str) -> tuple[ObjectMeta, BinaryIO] | None:
        """The object's meta, and the open file at the start of its body (one snapshot:
        a PUT meanwhile replaces the name, not what is open); None if there is none."""
        try:
            f = open(self._path(bucket, key), "rb")
        except FileNotFoundError:
            return None
        try:
            return self._meta_from(f, key), f
        except BaseException:
            f.close()
            raise

    def delete(self, bucket: str, key: str, durable: bool = True) -> None:
        """Gone (S3 answers a delete of a missing key the same way). Without `durable`, the
        directory is not fsync'd: a crash may bring the object back (retention's deletes,
        which the next sweep makes again)."""
        path = self._path(bucket, key)
        with self._lock(bucket, key):
            self._metas.pop((bucket, key), None)
            try:
                path.unlink()
            except FileNotFoundError:
                return
            self._removed(path.parent, path.name)
            if durable:
                self._fsync_dir(path.parent)

    def walk(self, bucket: str, prefix: str, after: str, group_dirs: bool) -> Iterator[str]:
        """Keys beginning with `prefix` and sorting after `after`, in S3's (UTF-8 byte)
        order. With `group_dirs`, a directory below the prefix is one entry, its key prefix
        ending in "/" (S3's CommonPrefixes for the delimiter "/")."""
        base = self._bucket(bucket)
        *whole, _ = prefix.split("/")  # the segments every listed key has in full
        directory, at = base, ""
        for segment in whole:
            directory, at = directory / ("d" + encode_segment(segment)), at + segment + "/"
        if directory.is_dir():
            yield from self._walk(directory, at, prefix, after, group_dirs)

    def _walk(
        self, directory: Path, at: str, prefix: str, after: str, group_dirs: bool
    ) -> Iterator[str]:
        children = self._children(directory)
        # Start at the first entry after `after`, or at the directory that holds it.
        start = bisect_right(children, after, key=lambda child: at + child[0])
        if start and children[start - 1][2] and after.startswith(at + children[start - 1][0]):
            start -= 1
        for segment, name, is_dir in children[start:]:
            key = at + segment
            if is_dir:
                # Skip what cannot hold a key with the prefix or after `after`.
                if not (key.startswith(prefix) or prefix.startswith(key)):
                    continue
                if key <= after and not after.startswith(key):
                    continue
                if group_dirs and len(key) > len(prefix):
                    if key > after and self._holds_objects(directory / name):
                        yield key
                    continue
                yield from self._walk(directory / name, key, prefix, after, group_dirs)
            elif key.startswith(prefix) and key > after:
                yield key

    def _children(self, directory: Path) -> list[Child]:
        """A directory's entries in key order, kept in memory once read (the broker lists
        the same partitions' records on every fetch) and updated by every write here."""
        with self._listing:
            cached = self._dirs.get(directory)
            if cached is None:
                if len(self._dirs) >= _REMEMBERED_DIRS:
                    self._dirs.clear()
                names = os.listdir(directory)
                cached = sorted(_child(name) for name in names if name[:1] in ("o", "d"))
                self._dirs[directory] = cached
            return list(cached)

    def _added(self, directory: Path, name: str) -> None:
        with self._listing:
            cached = self._dirs.get(directory)
            child = _child(name)
            if cached is not None:
                at = bisect_left(cached, child)
                if at == len(cached) or cached[at] != child:
                    cached.insert(at, child)

    def _removed(self, directory: Path, name: str) -> None:
        with self._listing:
            cached = self._dirs.get(directory)
            child = _child(name)
            if cached is not None:
                at = bisect_left(cached, child)
                if at < len(cached) and cached[at] == child:
                    del cached[at]

    def _holds_objects(self, directory: Path) -> bool:
        for name in os.listdir(directory):
            if name[:1] == "o" or (name[:1] == "d" and self._holds_objects(directory / name)):
                return True
        return False

    # -- paths, locks, durability -------------------------------------------------------------

    def _bucket(self, bucket: str, must_exist: bool = True) -> Path:
        if not bucket or "/" in bucket or bucket in (".", ".."):
            raise NoSuchBucket(bucket)
        path = self.buckets / bucket
        if must_exist and not path.is_dir():
            raise NoSuchBucket(bucket)
        return path

    def _path(self, bucket: str, key: str) -> Path:
        if not key:
            raise InvalidKey("an object needs a key")
        *dirs, last = key.split("/")
        names = ["d" + encode_segment(s) for s in dirs] + ["o" + encode_segment(last)]
        if any(len(name) > 255 for name in names):
            raise InvalidKey(f"a segment of {key[:80]!r} is too long (255 bytes once encoded)")
        return self._bucket(bucket).joinpath(*names)

    def _remember(self, name: tuple[str, str], meta: ObjectMeta) -> None:
        if len(self._metas) >= _REMEMBERED:  # bounded: start again rather than grow
            self._metas.clear()
        self._metas[name] = meta

    def _lock(self, bucket: str, key: str) -> threading.Lock:
        return self._locks[hash((bucket, key)) % _LOCKS]

    def _read_meta(self, path: Path, key: str) -> ObjectMeta | None:
        try:
            with open(path, "rb") as f:
                return self._meta_from(f, key)
        except FileNotFoundError:
            return None

    @staticmethod
    def _meta_from(f: BinaryIO, key: str) -> ObjectMeta:
        (length,) = HEADER.unpack(f.read(HEADER.size))
        header = json.loads(f.read(length))
        return ObjectMeta(key, header["etag"], header["size"], header["mtime"], header["headers"])

    def _ensure_dir(self, path: Path) -> None:
        if path.is_dir():
            return
        self._ensure_dir(path.parent)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            return
        self._fsync_dir(path.parent)
        self._added(path.parent, path.name)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
