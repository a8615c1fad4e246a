"""One storage interface, two backends: a local folder and S3 (or anything speaking S3).

`open_store("s3://bucket/prefix")` or `open_store("/some/folder")`. Every S3 request goes
through obstore (record/s3.py): the endpoint from boto3's standard AWS_ENDPOINT_URL, throttling
(503 SlowDown) and a connection lost retried with backoff, without a client-wide rate (`close`
makes ~60,000 requests at 1.5M accounts, under S3's 3,500 PUTs and 5,500 GETs a second a prefix).
Keys start with a partition digit (see pipeline.record.keys), so leave the prefix empty in
production: S3 partitions by the leading characters of the key.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, TypeVar

from pipeline.errors import CannotRun
from pipeline.record import s3
from pipeline.settings import aws_region, clock, gives_up_at, waited_past

if TYPE_CHECKING:
    from pipeline.settings import Settings

log = logging.getLogger("pipeline.record.storage")
T = TypeVar("T")


IN_FLIGHT = 64  # requests a command keeps in flight (close, verify), and the S3 client's pool holds
PAUSE_S = 1.0  # between a request's rounds of the client's own retries while S3 is out
_out_since: dict[str, float] = {}  # a store's URL: the start of its outage this process waits out (epoch)
_told: dict[str, Callable[[float], None]] = {}  # a store's URL: who notes its outages (the run's page)
_out_lock = threading.Lock()
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")


class StorageError(CannotRun, RuntimeError):
    pass


class Garbled(StorageError):
    """An object of the record read whole that is not what its writer wrote (not JSON, not the
    object's shape, or not its recorded bytes): edited or cut short in the store. Not a failed
    read: a reader of the record (verify) counts it changed (exit 1); any other command stops on
    it as on a failed read."""

    def __init__(self, url: str, key: str, what: str):
        super().__init__(f"{url}: object {key!r} {what}")
        self.url, self.key, self.what = url, key, what

    def __reduce__(self):
        return Garbled, (self.url, self.key, self.what)

    @property
    def problem(self) -> str:
        return f"{self.key}: changed (it {self.what})"


class NotAsWritten(Garbled):
    """The store gave an object whose bytes are not those its writer recorded (S3's CRC32 in its
    metadata), twice: changed in place, its metadata kept."""

    def __init__(self, url: str, key: str):
        super().__init__(url, key, "is not as it was written (its CRC32 is not its writer's): changed in the bucket")

    def __reduce__(self):
        return NotAsWritten, (self.url, self.key)

    @property
    def problem(self) -> str:
        """As verify names a changed object of the record."""
        return f"{self.key}: changed (not as it was written: its CRC32 is not its writer's)"


class NoObject(StorageError):
    """The store answered that no object has the key. Anything else a read meets (a disk or S3
    failing) is a plain StorageError: not read is not "not there", and a reader of the record
    (verify) must never report an object removed because it could not read it."""


def inside(store_url: str, key: str) -> str:
    """The key, if it stays under the store's root or prefix: a key built from a link, a report
    or any other outside value ("../../etc/x", "/etc/x") never reaches outside it."""
    if key.startswith("/") or "\\" in key or any(part in ("..", ".") for part in key.split("/")):
        raise StorageError(f"{store_url}: key {key[:120]!r} would leave the store")
    return key


def sha256(store: Store, key: str, chunk: int = 4 << 20) -> str:
    """An object's SHA-256, read a chunk at a time: a day's report CSV (225 MB at 1.5M accounts)
    is never held whole."""
    digest, size = hashlib.sha256(), store.size(key)
    for start in range(0, size, chunk):
        digest.update(store.read_range(key, start, min(size, start + chunk)))
    return digest.hexdigest()


def write_once(store: Store, key: str, data: bytes) -> bytes:
    """A create-only write, and the bytes the key holds after it: `data` when this write made the
    object, else what was there first. What is written once is never replaced (the signed archive,
    a delivery-log object), so the first writer's bytes are the ones every later attempt carries
    on. A write sent again after its reply was lost finds its own bytes there, equal to `data`:
    a lost reply is settled by reading the key back, never by writing again: here too when the
    client gave up on a reply that never came (the write may have landed)."""
    try:
        made = store.put_new(key, data)
    except StorageError as e:
        try:
            return store.get(key)
        except StorageError:
            raise e from None
    return data if made else store.get(key)


def read_json(store: Store, key: str) -> dict:
    """An object this job wrote as one JSON object. Anything else was cut short or edited
    in the bucket: one line naming the object, never a traceback."""
    try:
        value = json.loads(store.get(key))
    except ValueError as e:
        raise Garbled(store.url, key, f"is not valid JSON (truncated or edited?): {e}") from None
    if not isinstance(value, dict):
        raise Garbled(store.url, key, "is not a JSON object (edited?)")
    return value


def check_create_only(store: Store, key: str) -> None:
    """The delivery log's chain rests on the store refusing a second create-only write (S3's
    If-None-Match): a store that takes it lets two appends both write one number, and the
    first batch's entries are lost in silence. Tried on `key` before anything is written."""
    try:
        first = store.put_new(key, b"create-only check\n")
        second = store.put_new(key, b"create-only check, a second write\n")
    except StorageError:
        raise
    except Exception as e:  # an OSError from a file system without hard links
        raise StorageError(f"storage {store.url} does not support create-only writes (If-None-Match): "
                           f"{str(e).splitlines()[0][:200]}; the delivery log needs them") from None
    if second or not (first or store.exists(key)):
        raise StorageError(f"storage {store.url} accepted a second create-only write to {key!r} (it ignores "
                           "If-None-Match): two writers would overwrite each other's delivery-log entries; use a "
                           "store that refuses it (S3; versitygw with metadata, not --nometa)")


class Store(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...
    def put_new(self, key: str, data: bytes) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def lines(self, key: str) -> Iterator[str]: ...
    def keys(self, prefix: str, after: str = "") -> Iterator[str]: ...
    def md5s(self, prefix: str) -> Iterator[tuple[str, str]]: ...
    def size(self, key: str) -> int: ...
    def read_range(self, key: str, start: int, end: int) -> bytes: ...
    def stream_range(self, key: str, start: int, end: int, chunk: int) -> Iterator[bytes]: ...
    def put_file(self, key: str, path: str) -> None: ...


def tell(url: str, told: Callable[[float], None]) -> None:
    """`told(since)` at the start of an outage of the store this process waits out (epoch), and
    `told(0.0)` at its end: the run's page says what the day waits for (state.note_wait)."""
    _told[url] = told


def open_store(url: str, probe: bool = False, run: Settings | None = None) -> Store:
    """`probe`, for a command someone waits on: an S3 endpoint that refuses or does not answer is
    said in seconds, not after the ten attempts (~80 s) a day's requests are given to ride out a
    blip. `run`, a run's settings: an S3 outage past those attempts holds the run's requests, as
    its other dependencies' do, until the later of CN_STORE_PATIENCE_S from the outage's start
    and the run's deadline, rather than failing the notes in flight for one rerun to send."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[5:].partition("/")
        if not BUCKET.match(bucket):
            raise StorageError(f"storage URL {url!r}: {bucket!r} is not an S3 bucket name (3-63 lower-case letters, "
                               "digits, dots and hyphens)")
        store = S3Store(url, bucket, prefix.strip("/"), *((run.store_patience_s, run.deadline_at) if run else ()))
        if probe:
            store.probe()
        return store
    if "://" in url and not url.startswith("file://"):
        raise StorageError(f"unsupported storage URL {url!r}: use s3://bucket[/prefix] or a folder")
    return FolderStore(url.removeprefix("file://"))


class FolderStore:
    def __init__(self, root: str):
        self.url = root
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / inside(self.url, key)

    @contextmanager
    def _disk(self, doing: str, key: str) -> Iterator[None]:
        """The folder's OSErrors as the store's own: on a read, a missing file is NoObject; any
        other (a disk failing, a file system gone) is a StorageError, an outage as S3's is."""
        try:
            yield
        except OSError as e:
            if doing == "read" and isinstance(e, (FileNotFoundError, NotADirectoryError)):
                raise NoObject(f"{self.url}: no object {key!r}") from None
            raise StorageError(f"{self.url}: cannot {doing} {key!r}: {e.strerror or e}") from None

    def _staged(self, key: str, data: bytes) -> tuple[Path, str]:
        """The object's path, and a temporary file beside it holding `data`."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path, tmp

    def put(self, key: str, data: bytes) -> None:
        """Write to a temporary file and rename: a reader never sees half a PDF."""
        with self._disk("write", key):
            path, tmp = self._staged(key, data)
            os.replace(tmp, path)

    def put_new(self, key: str, data: bytes) -> bool:
        """Writes only if no object has the key (a hard link does not replace); False if one has."""
        with self._disk("write", key):
            path, tmp = self._staged(key, data)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):  # a file system without them
                    raise StorageError(f"storage {self.url} does not support create-only writes (hard links): "
                                       f"{e.strerror}; the delivery log needs them") from None
                raise
            finally:
                os.unlink(tmp)

    def get(self, key: str) -> bytes:
        with self._disk("read", key):
            return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        """Whether an object has the key; a stat that fails other than by its absence raises
        (Path.exists says False on ELOOP: a proof the disk could not read was no proof, never
        written)."""
        with self._disk("read", key):
            return _is(str(self._path(key)))

    def size(self, key: str) -> int:
        with self._disk("read", key):
            return self._path(key).stat().st_size

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes start..end-1 (fewer at the end of the object)."""
        with self._disk("read", key), self._path(key).open("rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def stream_range(self, key: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        """Bytes start..end-1, `chunk` at a time."""
        with self._disk("read", key), self._path(key).open("rb") as f:
            f.seek(start)
            while start < end and (data := f.read(min(chunk, end - start))):
                start += len(data)
                yield data

    def put_file(self, key: str, path: str) -> None:
        with self._disk("write", key):
            path_to = self._path(key)
            path_to.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path_to.parent, prefix=".tmp-")
            os.close(fd)
            shutil.copyfile(path, tmp)
            os.replace(tmp, path_to)

    def keys(self, prefix: str, after: str = "") -> Iterator[str]:
        """The keys under a folder-like prefix (ending in '/'), in S3's order (the keys' as strings,
        "RUN-2/x" before "RUN/x"); those after `after` only."""
        folder = self._path(prefix)
        with self._disk("list", prefix):
            if _is(str(folder), stat.S_ISDIR):  # os.walk told to raise: Path.rglob passes over a folder it cannot read
                found = []  # the keys alone (a day's partition of notes: 150,000 at 1.5M accounts)
                for top, _, names in os.walk(folder, onerror=_raise):
                    under = os.path.relpath(top, self.root) + "/"
                    found += [under + name for name in names if not name.startswith(".tmp-") and under + name > after]
                found.sort()
                yield from (key for key in found if _is(os.path.join(self.root, key), stat.S_ISREG))

    def md5s(self, prefix: str) -> Iterator[tuple[str, str]]:
        """The keys under a prefix with each object's MD5 (hex), as S3Store.md5s lists them."""
        for key in self.keys(prefix):
            yield key, hashlib.md5(self.get(key)).hexdigest()

    def lines(self, key: str) -> Iterator[str]:
        """Bytes that are not UTF-8 come through as surrogates, for the row check to name;
        a byte-order mark (what Excel writes) is dropped."""
        with self._disk("read", key), \
                self._path(key).open(newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
            yield from f


def _raise(error: OSError) -> None:
    raise error


def _is(path: str, kind: Callable[[int], bool] = bool) -> bool:
    """os.path.exists, isfile or isdir (`kind`: any, stat.S_ISREG, S_ISDIR), but a stat that
    fails other than by the path's absence (EIO on a failing disk, ELOOP) raises. Those said
    False, and a listing of the record passed over the object, or read its folder as empty, as
    if never written: verify then named it removed (tampered)."""
    try:
        return kind(os.stat(path).st_mode)  # bool: any mode is some kind of file
    except (FileNotFoundError, NotADirectoryError):  # removed since the walk, or a link to nothing
        return False


def _whole(got) -> tuple[bytes, dict]:
    return got.bytes().to_bytes(), got.attributes


class StoreOut(StorageError):
    """S3 stayed out past the wait the run gives it."""


class S3Store:
    """A bucket (keys under a prefix) through obstore (record/s3.py), every request of it. A run's
    (`patience_s`, `deadline_at`: open_store's `run`) waits out an outage; anyone else's request
    fails once the client's own attempts are spent."""

    def __init__(self, url: str, bucket: str, prefix: str = "", patience_s: float = 0.0, deadline_at: float = 0.0):
        self.url, self.bucket, self.prefix = url, bucket, prefix
        self.patience_s, self.deadline_at = patience_s, deadline_at
        self.objects = s3.store(bucket, prefix, aws_region())

    def __reduce__(self):
        """Sent to another process (record/spread.py) as its URL and its wait: a client of its own there."""
        return S3Store, (self.url, self.bucket, self.prefix, self.patience_s, self.deadline_at)

    def _held(self, request: Callable[[], T]) -> T:
        """request(), made again while S3 is out (s3.out) until the later of the patience from the
        outage's start (this process's first request of it to fail) and the run's deadline; said
        at WARNING once an outage a process, and when S3 is back. A create-only PUT made again
        after its reply was lost is refused by its own object: write_once reads it back."""
        began, since = time.time(), 0.0
        while True:
            try:
                result = request()
            except Exception as e:
                if not s3.out(e) or not (self.patience_s or self.deadline_at):
                    raise
                since = since or self._lost(began, e)
                left = gives_up_at(since, self.patience_s, self.deadline_at) - time.time()
                if left <= 0:
                    past = waited_past(since, self.patience_s, self.deadline_at, "CN_STORE_PATIENCE_S")
                    raise StoreOut(f"{s3.reason(e)}, S3 out since {clock(since)}, past {past}") from None
                time.sleep(min(PAUSE_S, left))
                continue
            if since or self.url in _out_since:  # an outage another request met, over
                self._back()
            return result

    def _lost(self, began: float, error: Exception) -> float:
        """The outage's start: this process's first request of it to fail."""
        with _out_lock:  # the page's note in the lock too: never set after the outage was said over
            if since := _out_since.get(self.url):
                return since
            _out_since[self.url] = began
            log.warning("waiting for the store (%s) since %s, until %s: %s", self.url, clock(began),
                        clock(gives_up_at(began, self.patience_s, self.deadline_at)), s3.reason(error))
            self._tell(began)
        return began

    def _back(self) -> None:
        with _out_lock:
            since = _out_since.pop(self.url, 0.0)
            if since:
                log.warning("the store (%s) is back after %.0f s", self.url, time.time() - since)
                self._tell(0.0)

    def _tell(self, since: float) -> None:
        try:
            _told.get(self.url, lambda since: None)(since)
        except Exception as e:  # the page's note only: the wait goes on without it
            log.warning("the store's outage could not be noted for the run's page: %s", e)

    def probe(self) -> None:
        """One HEAD (of a key "probe"), two attempts, five seconds to connect: any answer at all
        (a 403, a 404) is the command's to say; no answer is said here."""
        import obstore

        try:
            obstore.head(s3.store(self.bucket, self.prefix, aws_region(), quick=True), "probe")
        except Exception as e:
            if not s3.answered(e) and not isinstance(e, FileNotFoundError):
                raise StorageError(f"{self.url}: {s3.reason(e)}") from None

    def _failed(self, doing: str, key: str, e: Exception) -> StorageError:
        said = str(e) if isinstance(e, StoreOut) else s3.reason(e)
        return (NoObject if said == "NoSuchKey" else StorageError)(f"{self.url}: cannot {doing} {key!r}: {said}")

    def put(self, key: str, data: bytes) -> None:
        import obstore

        try:
            self._held(lambda: s3.sent(lambda: obstore.put(self.objects, inside(self.url, key), data,
                                                           attributes={s3.CRC32: s3.crc32(data)})))
        except Exception as e:
            raise self._failed("write", key, e) from None

    def put_new(self, key: str, data: bytes) -> bool:
        """A conditional PUT (If-None-Match: *): S3 refuses it (412, or 409 while another such PUT
        of the key is under way) when the key exists; False then. A close adds one to each of a
        day's 15,000 chains."""
        import obstore

        try:
            self._held(lambda: s3.sent(lambda: obstore.put(self.objects, inside(self.url, key), data, mode="create",
                                                           attributes={s3.CRC32: s3.crc32(data)})))
            return True
        except obstore.exceptions.AlreadyExistsError:
            return False
        except Exception as e:
            said = s3.reason(e)
            if said in ("ConditionalRequestConflict", "409"):
                return False
            if said == "NotImplemented":
                raise StorageError(f"storage {self.url} does not support create-only writes (If-None-Match): "
                                   "NotImplemented; the delivery log needs them") from None
            raise self._failed("write", key, e) from None

    def get(self, key: str) -> bytes:
        """The whole object, held to the CRC32 it was written with (read twice before it is
        refused: a transfer gone wrong is not the object): the record's readers make tens of
        thousands of these."""
        import obstore

        try:
            for _ in range(2):
                data, attributes = self._held(lambda: _whole(obstore.get(self.objects, inside(self.url, key))))
                if s3.intact(data, attributes):
                    return data
        except Exception as e:
            raise self._failed("read", key, e) from None
        raise NotAsWritten(self.url, key)

    def size(self, key: str) -> int:
        import obstore

        try:
            return self._held(lambda: obstore.head(self.objects, inside(self.url, key)))["size"]
        except Exception as e:
            raise self._failed("read", key, e) from None

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """One ranged GET: a split task reads only its own part of a day's dump."""
        return b"".join(self.stream_range(key, start, end, max(1, end - start)))

    def stream_range(self, key: str, start: int, end: int, chunk: int) -> Iterator[bytes]:
        """One ranged GET, its body read `chunk` at a time: a split task holds a chunk of its
        part of a day's dump, never the part, for one request. Fewer bytes at the object's end,
        none from past it."""
        import obstore

        if end <= start:
            return
        try:
            got = self._held(lambda: obstore.get(self.objects, inside(self.url, key), options={"range": (start, end)}))
        except Exception as e:
            if s3.reason(e) == "InvalidRange":  # starts at or past the end
                return
            raise self._failed("read", key, e) from None
        try:
            for data in got.stream(min_chunk_size=chunk):
                yield bytes(data)
        except Exception as e:
            raise self._failed("read", key, e) from None

    def put_file(self, key: str, path: str) -> None:
        """A multipart upload for a file over 5 MB, four parts in flight: memory stays flat."""
        import obstore

        try:
            self._held(lambda: s3.sent(lambda: obstore.put(self.objects, inside(self.url, key), Path(path),
                                                           max_concurrency=4)))
        except Exception as e:
            raise self._failed("write", key, e) from None

    def exists(self, key: str) -> bool:
        import obstore

        try:
            self._held(lambda: obstore.head(self.objects, inside(self.url, key)))
            return True
        except FileNotFoundError:
            return False
        except Exception as e:
            raise self._failed("read", key, e) from None

    def _listed(self, prefix: str, after: str = "") -> Iterator[dict]:
        """The objects under a folder-like prefix (ending in '/'), in order, those after `after`
        only (ListObjectsV2, a page per 1000 keys, from StartAfter). A page that S3, out, did not
        give is asked for again by a listing from the last key given."""
        import obstore

        pages, last = None, after

        def page() -> list[dict] | None:
            nonlocal pages
            pages = pages or iter(obstore.list(self.objects, offset=inside(self.url, last) if last else None,
                                               prefix=inside(self.url, prefix.rstrip("/")) if prefix else None))
            try:
                return next(pages, None)
            except Exception:
                pages = None
                raise

        try:
            while (items := self._held(page)) is not None:
                for item in items:
                    last = item["path"]
                    yield item
        except Exception as e:
            raise self._failed("list", prefix, e) from None

    def keys(self, prefix: str, after: str = "") -> Iterator[str]:
        for item in self._listed(prefix, after):
            yield item["path"]

    def md5s(self, prefix: str) -> Iterator[tuple[str, str]]:
        """The keys under a prefix with each object's MD5 (hex) as the listing gives it: S3's
        ETag of an object written in one PUT without SSE-KMS or SSE-C; "" for any other (a
        multipart upload's ETag, "...-N"). Under SSE-KMS an ETag is not the MD5: a reader that
        finds them differ reads the object."""
        for item in self._listed(prefix):
            etag = (item["e_tag"] or "").strip('"')
            yield item["path"], etag if len(etag) == 32 and "-" not in etag else ""

    def lines(self, key: str) -> Iterator[str]:
        """Streams the object: a day's trade file is never held in memory whole."""
        import obstore

        try:
            body = s3.Body(iter(self._held(lambda: obstore.get(self.objects, inside(self.url, key)))
                                .stream(min_chunk_size=1 << 20)))
        except Exception as e:
            raise self._failed("read", key, e) from None
        try:  # a body cut short past the client's own resumes is a failed read too, never a traceback
            yield from io.TextIOWrapper(io.BufferedReader(body, 1 << 20), encoding="utf-8-sig",
                                        errors="surrogateescape", newline="")
        except Exception as e:
            raise self._failed("read", key, e) from None
