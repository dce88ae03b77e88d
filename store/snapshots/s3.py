"""Snapshots in S3-compatible object storage (AWS S3, MinIO, …): extra ``ratchet[s3]``.

URL: ``s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&region=us-east-1``
(``endpoint_url`` and ``region`` are optional; AWS's defaults apply without
them). Credentials come from boto3's standard chain — the ``AWS_*``
environment variables, ``~/.aws/config``, an instance or pod role — and are
never part of the URL, a log line or an error message.

Object layout under ``prefix``::

    heads/<run_id>                                       the run's head (written last)
    transcripts/<run_id>/<start>-<end>-<before>-<after>  messages [start, end) of the transcript
    quarantine/<run_id>.<UTC time>/heads/… transcripts/…  an unusable snapshot moved aside

A head is a zlib-packed JSON line ``{"seq", "form", "length", "size",
"chain", "path", "garbage"}`` followed by the document with an empty
transcript (``form: parts``) or the whole document (``form: whole``).
``<before>`` and ``<after>`` in a transcript object's name are the first 16
hex digits of the transcript's hash chain before and after its messages.

**Flat loads.** ``path`` names the transcript objects that hold the head's
messages, in order: at most :data:`LOAD_OBJECTS` (3) of them, so a load is one
GET of the head and at most three GETs, made at once, however long the run.
Each save writes one transcript object, then the head: the object holds the
save's new messages, and, when the path would otherwise grow past three objects
or its last objects grow out of proportion, also the messages of the last
objects of the path, which it replaces (:func:`absorbed`). The objects of a
path of T messages hold about T, T^(2/3) and T^(1/3) of them, so a message is
rewritten a few times over a run, growing with the cube root of its length
(bench/s3_loads.py measures it). ``garbage`` lists objects earlier heads
replaced; a save deletes them, after its own head is stored, once 16 have
gathered, so an object is deleted only when the head that stopped naming it
is no longer the current one. Heads written before ``path`` existed name no
path: a load lists the run's objects and walks back from the tip through the
``<before>``/``<after>`` names, one GET per earlier save (as that release
did), and the run's next save rewrites its transcript as one object. A head
with a path stays readable by that walk, so a release without ``path`` still
loads what this one writes.

**Crash safety.** The transcript object is written before the head, so a head
never names messages that are not stored, and the head's hash chain over its
path's messages is checked on every load, so no mix of two saves is ever
returned. A save that dies between the two, or that loses the compare-and-set,
leaves an orphan object no head names: it is ignored, and overwritten by an
identical one if the same messages are saved again. ``delete`` removes the
head first, then every object of the run (orphans and garbage included).

**Compare-and-set.** A save reads the head, checks its seq, and writes the new
head with ``If-Match: <etag>`` (``If-None-Match: *`` for a run with no
snapshot); the new head records the etag it replaced (``base``). AWS S3 (since
November 2024) evaluates the condition and stores the object as one step, so
of two racing saves exactly one succeeds and the other gets 412 (or 409
``ConditionalRequestConflict``), reported as StaleWrite.

moto's server (the test server) honours both headers but checks the condition
and stores the object in two steps without a lock: measured here, 4 racing
conditional PUTs on one key had more than one winner in 64 of 300 rounds. So
every save reads the head back after writing it: if it finds another head
that replaced the same ``base``, it lost a race the server did not refuse and
raises StaleWrite. On such a server the guarantee is weaker and exact: of
concurrent saves expecting the same seq, at most one reports success, unless a
further save, built on the winner, completes between a loser's PUT and its
read-back (milliseconds); then that loser may also report success, while the
stored snapshot is the winner's line. Every stale save that runs alone is
refused on any server. Ratchet's lease and the event log's fence (a
write names the seq it follows) keep two workers from both advancing a run either way; the
read-back costs one small GET per save.

**Why boto3, not obstore.** boto3 is what operators of AWS already run and
configure (the credential chain above, profiles, IRSA, STS), installs as pure
Python everywhere, and has passed ``IfMatch``/``IfNoneMatch`` on
``put_object`` since botocore 1.35; moto's server is tested against it.
obstore (Rust ``object_store``) has conditional puts too and is faster for
bulk transfer, but a checkpoint is a few KiB, and a compiled dependency plus a
second credential system is not worth that for this store.
"""

from __future__ import annotations

import builtins
import json
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from runtime.errors import SnapshotMalformed, StaleWrite, StoreError, StoreUnavailable
from runtime.models import RunState
from store.packing import pack, unpack
from store.snapshots import Parts, SnapshotStore, TranscriptMoved, TranscriptTip
from store.snapshots import format as snapshot_format

INSTALL_HINT = "pip install 'ratchet[s3]'"
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 15.0
READ_THREADS = 8
"""Transcript objects fetched at once when a snapshot is loaded."""
HASH_DIGITS = 16
LOAD_OBJECTS = 3
"""Transcript objects a head's path names at most: a load makes one more GET than this."""
GARBAGE_BATCH = 16
"""Replaced transcript objects a head lists before a save deletes them (one request)."""
_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_TRANSIENT_CODES = frozenset(
    {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
     "RequestTimeout", "RequestTimeTooSkewed"}
)  # fmt: skip


log = logging.getLogger(__name__)


def _boto3() -> Any:
    try:
        import boto3
    except ImportError as exc:
        raise ImportError(
            f"the s3:// snapshot store needs boto3, which is not installed: {INSTALL_HINT}"
        ) from exc
    return boto3


@dataclass(frozen=True)
class Span:
    """One transcript object: messages ``[start, end)``, between two points of the chain."""

    start: int
    end: int
    before: str
    """The hash chain before its first message (its first :data:`HASH_DIGITS` digits)."""
    after: str
    """The hash chain after its last message (the same digits)."""

    @property
    def name(self) -> str:
        """The object's name under ``transcripts/<run_id>/``."""
        return f"{self.start:010d}-{self.end:010d}-{self.before}-{self.after}"

    @classmethod
    def parse(cls, name: str) -> Span:
        """The span an object's name describes; ValueError for a name that is not one."""
        start, end, before, after = name.split("-")
        span = cls(int(start), int(end), before, after)
        if span.name != name or not 0 <= span.start < span.end:
            raise ValueError(f"not a transcript object's name: {name[:80]!r}")
        return span


def absorbed(path: Sequence[Span], end: int) -> int:
    """How many of ``path``'s last objects the save that stores messages up to ``end``
    rewrites into its own object (the rest it keeps), so that loads stay flat.

    The new object takes the path's last object while the path would otherwise hold
    more than :data:`LOAD_OBJECTS`, while that object is no larger than what the new
    one holds so far, or while the new one holds more than its place's share: the
    object at place ``k`` (0 first) of a path of ``end`` messages is given up to
    ``end ** ((LOAD_OBJECTS - k) / LOAD_OBJECTS)`` messages. The objects' sizes thus
    fall geometrically along the path, and a save rewrites the small last ones often
    and the large first one rarely.
    """
    kept = len(path)
    holds = end - (path[-1].end if path else 0)
    while kept > 0 and (
        kept + 1 > LOAD_OBJECTS
        or path[kept - 1].end - path[kept - 1].start <= holds
        or holds >= end ** ((LOAD_OBJECTS - kept) / LOAD_OBJECTS)
    ):
        holds += path[kept - 1].end - path[kept - 1].start
        kept -= 1
    return len(path) - kept


@dataclass(frozen=True)
class _Head:
    etag: str
    base: str
    """The etag of the head this one replaced (``""``: none)."""
    seq: int
    tip: TranscriptTip | None
    """``None`` for a document stored whole."""
    document: bytes
    """The head document (``tip`` set) or the whole document."""
    path: tuple[Span, ...] | None = None
    """The transcript objects, in order; ``None``: a head from before paths (walk them)."""
    garbage: tuple[str, ...] = ()
    """Names of objects earlier heads replaced, not deleted yet."""


def _frame(fragments: tuple[bytes, ...]) -> bytes:
    return b"".join(b"%d\n%s" % (len(f), f) for f in fragments)


def _unframe(data: bytes) -> list[bytes]:
    fragments, at = [], 0
    while at < len(data):
        newline = data.index(b"\n", at)
        size = int(data[at:newline])
        fragments.append(data[newline + 1 : newline + 1 + size])
        at = newline + 1 + size
    if at != len(data):
        raise ValueError("a transcript object ends inside a message")
    return fragments


class S3SnapshotStore(SnapshotStore):
    name = "s3 snapshot store"
    appends_transcript = True

    def __init__(self, client: Any, bucket: str, prefix: str = "", where: str = "s3") -> None:
        super().__init__()
        self._client = client
        self._bucket = bucket
        self._prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self._where = f"snapshot store {where}"
        self.bytes_written = 0
        """Body bytes of every PUT (heads and transcript objects): what checkpoints cost."""
        self.puts = 0

    @classmethod
    def from_url(cls, url: str) -> S3SnapshotStore:
        """Open ``s3://bucket/prefix?endpoint_url=…&region=…``; connects lazily."""
        boto3 = _boto3()
        from botocore.config import Config

        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or "@" in parts.netloc:
            raise ValueError(
                f"snapshot store URL `{parts.scheme}://{parts.hostname or ''}…`: use "
                "s3://bucket/prefix?endpoint_url=…&region=… (credentials come from the "
                "AWS_* environment variables or ~/.aws, never the URL)"
            )
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = sorted(set(query) - {"endpoint_url", "region"})
        if unknown:
            raise ValueError(
                f"s3://{parts.netloc}{parts.path}: unknown parameter(s) {', '.join(unknown)}; "
                "accepted: endpoint_url, region"
            )
        config = Config(
            connect_timeout=CONNECT_TIMEOUT_S,
            read_timeout=READ_TIMEOUT_S,
            # store.retry is the one retry policy: a dead endpoint costs its bounded ~2 s.
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=READ_THREADS * 2,
            s3={"addressing_style": "path"} if "endpoint_url" in query else None,
        )
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=query.get("endpoint_url"),
            region_name=query.get("region"),
            config=config,
        )
        shown = f"s3://{parts.netloc}{parts.path}"
        if "endpoint_url" in query:
            shown += f" at {query['endpoint_url']}"
        return cls(client, parts.netloc, unquote(parts.path), shown)

    # --- keys -----------------------------------------------------------------

    def _head_key(self, run_id: str) -> str:
        return f"{self._prefix}heads/{run_id}"

    def _transcript_prefix(self, run_id: str) -> str:
        return f"{self._prefix}transcripts/{run_id}/"

    # --- errors ---------------------------------------------------------------

    @contextmanager
    def _translated(self) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _TRANSIENT_CODES or status.startswith("5"):
                raise StoreUnavailable(self._where, f"{code or status}: {exc}") from exc
            if code == "NoSuchBucket":
                raise StoreError(
                    f"{self._where}: bucket {self._bucket} does not exist; create it "
                    f"(`aws s3 mb s3://{self._bucket}`) or fix RATCHET_SNAPSHOT_STORE"
                ) from exc
            raise StoreError(
                f"{self._where} refused a request ({code or status}): {exc}; check the "
                "bucket's permissions and the AWS credentials this worker uses"
            ) from exc
        except BotoCoreError as exc:
            # Connection refused or reset, timeouts, DNS: the endpoint is not there now.
            raise StoreUnavailable(self._where, str(exc) or type(exc).__name__) from exc

    @staticmethod
    def _code(exc: Exception) -> str:
        response = getattr(exc, "response", {})
        return str(response.get("Error", {}).get("Code", ""))

    # --- objects --------------------------------------------------------------

    def _put_object(self, key: str, body: bytes, **condition: str) -> str:
        """PUT one object; its ETag."""
        written = self._client.put_object(
            Bucket=self._bucket,
            Key=key,
            Body=body,
            ContentType="application/octet-stream",
            **condition,
        )
        self.bytes_written += len(body)
        self.puts += 1
        return str(written.get("ETag", ""))

    def _get_object(self, key: str) -> tuple[str, bytes] | None:
        from botocore.exceptions import ClientError

        try:
            found = self._client.get_object(Bucket=self._bucket, Key=key)
        except ClientError as exc:
            if self._code(exc) in _MISSING_CODES:
                return None
            raise
        return str(found["ETag"]), bytes(found["Body"].read())

    def _keys(self, prefix: str) -> Iterator[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self._bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                yield str(item["Key"])

    def _read_head(self, run_id: str) -> _Head | None:
        found = self._get_object(self._head_key(run_id))
        if found is None:
            return None
        etag, body = found
        what = self.where(run_id)
        try:
            line, _, document = unpack(body, self.max_bytes + 4096).partition(b"\n")
            meta = json.loads(line)
            tip = None
            if meta["form"] == "parts":
                tip = TranscriptTip(int(meta["length"]), int(meta["size"]), str(meta["chain"]))
            path = meta.get("path")
            return _Head(
                etag,
                str(meta.get("base", "")),
                int(meta["seq"]),
                tip,
                document,
                None if path is None else tuple(Span.parse(str(name)) for name in path),
                tuple(str(name) for name in meta.get("garbage", ())),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise SnapshotMalformed(
                what,
                f"its head object is unreadable ({exc}); delete it and `ratchet runs resume "
                f"{run_id}` rebuilds the snapshot from the run's events",
            ) from exc

    def _write_head(
        self, run_id: str, found: _Head | None, meta: dict[str, Any], document: bytes
    ) -> None:
        """Replace ``found`` by this head (compare-and-set); StaleWrite if another got there."""
        base = found.etag if found is not None else ""
        body = pack(json.dumps({**meta, "base": base}, sort_keys=True).encode() + b"\n" + document)
        condition = {"IfMatch": base} if found is not None else {"IfNoneMatch": "*"}
        expected = found.seq if found is not None else None
        from botocore.exceptions import ClientError

        try:
            etag = self._put_object(self._head_key(run_id), body, **condition)
        except ClientError as exc:
            if self._code(exc) not in _CONFLICT_CODES:
                raise
            # Another save replaced the head since we read it: the CAS is lost.
            now = self._read_head(run_id)
            raise StaleWrite(run_id, expected, now.seq if now else None) from exc
        # A server whose conditional PUT is not atomic (moto) may let a racing save
        # through as well: whoever finds the other's head on the same base lost.
        now = self._read_head(run_id)
        if now is not None and now.etag != etag and now.base == base:
            raise StaleWrite(run_id, expected, now.seq)

    # --- primitives -----------------------------------------------------------

    def _put(self, run_id: str, state: RunState, data: bytes, expected_seq: int | None) -> None:
        with self._translated():
            found = self._read_head(run_id)
            if (found.seq if found else None) != expected_seq:
                raise StaleWrite(run_id, expected_seq, found.seq if found else None)
            self._write_head(run_id, found, {"form": "whole", "seq": state.seq}, data)

    def _put_parts(self, run_id: str, parts: Parts, expected_seq: int | None) -> None:
        with self._translated():
            found = self._read_head(run_id)
            if (found.seq if found else None) != expected_seq:
                raise StaleWrite(run_id, expected_seq, found.seq if found else None)
            if parts.base is not None and (found is None or found.tip != parts.base):
                raise TranscriptMoved(run_id)
            stored = found.path if found is not None and parts.base is not None else ()
            path = self._put_transcript(run_id, parts, stored)
            replaced = () if found is None else found.path or ()
            named = {span.name for span in path or ()}
            garbage = [span.name for span in replaced if span.name not in named]
            pending = [n for n in (found.garbage if found else ()) if n not in named]
            collect = len(pending) >= GARBAGE_BATCH
            meta: dict[str, Any] = {
                "form": "parts",
                "seq": parts.seq,
                "length": parts.tip.length,
                "size": parts.tip.size,
                "chain": parts.tip.chain,
                "garbage": garbage if collect else pending + garbage,
            }
            if path is not None:
                meta["path"] = [span.name for span in path]
            self._write_head(run_id, found, meta, parts.head)
            if collect:
                # Replaced by a head that is itself replaced now: no current head names them.
                self._delete_objects(run_id, pending)

    def _put_transcript(
        self, run_id: str, parts: Parts, stored: tuple[Span, ...] | None
    ) -> tuple[Span, ...] | None:
        """Write the save's transcript object; the path its head names (None: a head from
        before paths stays one, as the save adds no messages to it)."""
        if not parts.fragments:
            return stored
        # A head from before paths: its objects are not known without a listing, so
        # this save rewrites the transcript as one object (once per run).
        keep = () if stored is None else stored[: len(stored) - absorbed(stored, parts.tip.length)]
        start = keep[-1].end if keep else 0
        before = keep[-1].after if keep else snapshot_format.GENESIS[:HASH_DIGITS]
        span = Span(start, parts.tip.length, before, parts.tip.chain[:HASH_DIGITS])
        fragments = parts.fragments_from(start)
        self._put_object(self._transcript_prefix(run_id) + span.name, pack(_frame(fragments)))
        return (*keep, span)

    def _delete_objects(self, run_id: str, names: Sequence[str]) -> None:
        """Delete transcript objects no head names any more; a failure only leaves them
        for the run's ``delete``."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self._transcript_prefix(run_id)
        try:
            self._client.delete_objects(
                Bucket=self._bucket,
                Delete={"Objects": [{"Key": prefix + n} for n in names], "Quiet": True},
            )
        except (BotoCoreError, ClientError) as exc:
            log.warning(
                "run %s: %d replaced transcript objects were not deleted (%s); deleting the "
                "run's snapshot removes them",
                run_id,
                len(names),
                exc,
            )

    def _read_tip(self, run_id: str) -> tuple[int, TranscriptTip | None] | None:
        with self._translated():
            found = self._read_head(run_id)
        return (found.seq, found.tip) if found is not None else None

    def _read(self, run_id: str) -> tuple[bytes, TranscriptTip | None] | None:
        with self._translated():
            for _ in range(3):
                head = self._read_head(run_id)
                if head is None:
                    return None
                if head.tip is None:
                    return unpack(head.document, self.max_bytes), None
                fragments = (
                    self._walk(run_id, head.tip)
                    if head.path is None
                    else self._fetch(run_id, head.path, head.tip)
                )
                if fragments is not None:
                    return snapshot_format.assemble(head.document, fragments), head.tip
                # A transcript object is missing: a delete (or a new save) ran meanwhile.
                again = self._read_head(run_id)
                if again is not None and again.etag == head.etag:
                    raise SnapshotMalformed(
                        f"snapshot of run {run_id} in {self._where}",
                        "a transcript object its head names is missing; delete the snapshot "
                        f"and `ratchet runs resume {run_id}` rebuilds it from the run's events",
                    )
        raise StoreUnavailable(self._where, f"run {run_id}'s snapshot kept changing while read")

    def _walk(self, run_id: str, tip: TranscriptTip) -> list[bytes] | None:
        """A head from before paths: the messages ``tip`` was built from, found by listing
        the run's objects and walking back from the tip; ``None`` if an object is missing."""
        if tip.length == 0:
            return []
        prefix = self._transcript_prefix(run_id)
        by_end: dict[tuple[int, str], Span] = {}
        for key in self._keys(prefix):
            try:
                span = Span.parse(key[len(prefix) :])
            except ValueError:
                continue  # not ours
            by_end[(span.end, span.after)] = span
        path: list[Span] = []
        at = (tip.length, tip.chain[:HASH_DIGITS])
        genesis = snapshot_format.GENESIS[:HASH_DIGITS]
        while at != (0, genesis):
            link = by_end.get(at)
            if link is None:
                return None
            path.append(link)
            at = (link.start, link.before)
        path.reverse()
        return self._fetch(run_id, path, tip)

    def _fetch(self, run_id: str, path: Sequence[Span], tip: TranscriptTip) -> list[bytes] | None:
        """The messages of ``path``'s objects, checked against ``tip``; ``None`` if an object
        is missing (a save or a delete replaced it since the head was read)."""
        if not path:
            bodies: list[tuple[str, bytes] | None] = []
        elif len(path) == 1:
            bodies = [self._get_object(self._transcript_prefix(run_id) + path[0].name)]
        else:
            keys = [self._transcript_prefix(run_id) + span.name for span in path]
            with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(keys))) as pool:
                bodies = list(pool.map(self._get_object, keys))
        fragments: list[bytes] = []
        for body in bodies:
            if body is None:
                return None
            try:
                fragments += _unframe(unpack(body[1], self.max_bytes))
            except ValueError as exc:
                raise SnapshotMalformed(f"snapshot of run {run_id}", str(exc)) from exc
        if (
            len(fragments) != tip.length
            or snapshot_format.chain(snapshot_format.GENESIS, fragments) != tip.chain
        ):
            raise SnapshotMalformed(
                f"snapshot of run {run_id} in {self._where}",
                "its transcript objects do not hash to the head's chain; delete the snapshot "
                f"and `ratchet runs resume {run_id}` rebuilds it from the run's events",
            )
        return fragments

    def _get(self, run_id: str) -> bytes | None:
        found = self._read(run_id)
        return found[0] if found is not None else None

    def _delete(self, run_id: str) -> None:
        with self._translated():
            # The head first: a reader never finds a head whose transcript is going.
            self._client.delete_object(Bucket=self._bucket, Key=self._head_key(run_id))
            keys = list(self._keys(self._transcript_prefix(run_id)))
            for i in range(0, len(keys), 1000):
                self._client.delete_objects(
                    Bucket=self._bucket,
                    Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
                )

    def where(self, run_id: str) -> str:
        return f"snapshot of run {run_id} in {self._where}"

    def _quarantine(self, run_id: str, stamp: str) -> str | None:
        aside = f"{self._prefix}quarantine/{run_id}.{stamp}/"
        with self._translated():
            keys = [self._head_key(run_id), *self._keys(self._transcript_prefix(run_id))]
            if self._get_object(keys[0]) is None:
                return None
            # Copied first and deleted after: a crash between leaves two copies, never none.
            for key in keys:
                self._client.copy_object(
                    Bucket=self._bucket,
                    Key=aside + key[len(self._prefix) :],
                    CopySource={"Bucket": self._bucket, "Key": key},
                )
        self._delete(run_id)
        return f"s3://{self._bucket}/{aside}"

    def _list(self) -> builtins.list[str]:
        prefix = f"{self._prefix}heads/"
        with self._translated():
            return [key[len(prefix) :] for key in self._keys(prefix)]

    def close(self) -> None:
        self._client.close()
