"""Snapshots in S3-compatible object storage (AWS S3, MinIO, …): extra ``ratchet[s3]``.

URL: ``s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&region=us-east-1``
(``endpoint_url`` and ``region`` are optional; AWS's defaults apply without
them). Credentials come from boto3's standard chain — the ``AWS_*``
environment variables, ``~/.aws/config``, an instance or pod role — and are
never part of the URL, a log line or an error message.

Object layout under ``prefix``::

    heads/<run_id>                                       the run's head (written last)
    transcripts/<run_id>/<start>-<end>-<before>-<after>  messages [start, end) of one save
    quarantine/<run_id>.<UTC time>/heads/… transcripts/…  an unusable snapshot moved aside

A head is a zlib-packed JSON line ``{"seq", "form", "length", "size",
"chain"}`` followed by the document with an empty transcript (``form:
parts``) or the whole document (``form: whole``). Each save writes one
transcript object holding only its new messages, then the head. ``<before>``
and ``<after>`` are the first 16 hex digits of the transcript's hash chain
before and after those messages, so a reader walks back from the head's tip to
the empty transcript and picks exactly the objects that head was built on.

**Crash safety.** The transcript object is written before the head, so a head
never names messages that are not stored. A save that dies between the two,
or that loses the compare-and-set, leaves an orphan object no head's chain
walks through: it is ignored, and overwritten by an identical one if the same
messages are saved again. ``delete`` removes the head first, then every
object of the run (orphans included).

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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from runtime.errors import SnapshotMalformed, StaleWrite, StoreError, StoreUnavailable
from runtime.models import RunState
from store.packing import pack, unpack
from store.snapshots import EMPTY_TIP, Parts, SnapshotStore, TranscriptMoved, TranscriptTip
from store.snapshots import format as snapshot_format

INSTALL_HINT = "pip install 'ratchet[s3]'"
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 15.0
READ_THREADS = 8
"""Transcript objects fetched at once when a snapshot is loaded."""
HASH_DIGITS = 16
_CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_TRANSIENT_CODES = frozenset(
    {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
     "RequestTimeout", "RequestTimeTooSkewed"}
)  # fmt: skip


def _boto3() -> Any:
    try:
        import boto3
    except ImportError as exc:
        raise ImportError(
            f"the s3:// snapshot store needs boto3, which is not installed: {INSTALL_HINT}"
        ) from exc
    return boto3


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

    def _chunk_key(self, run_id: str, before: TranscriptTip, after: TranscriptTip) -> str:
        return (
            f"{self._transcript_prefix(run_id)}{before.length:010d}-{after.length:010d}-"
            f"{before.chain[:HASH_DIGITS]}-{after.chain[:HASH_DIGITS]}"
        )

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
            return _Head(etag, str(meta.get("base", "")), int(meta["seq"]), tip, document)
        except (ValueError, KeyError, TypeError) as exc:
            raise SnapshotMalformed(
                what,
                f"its head object is unreadable ({exc}); delete it and `ratchet runs resume "
                f"{run_id}` rebuilds the snapshot from the run's events",
            ) from exc

    def _write_head(
        self, run_id: str, found: _Head | None, meta: dict[str, Any], document: bytes
    ) -> None:
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
            if parts.fragments:
                before = parts.base if parts.base is not None else EMPTY_TIP
                key = self._chunk_key(run_id, before, parts.tip)
                self._put_object(key, pack(_frame(parts.fragments)))
            meta = {
                "form": "parts",
                "seq": parts.seq,
                "length": parts.tip.length,
                "size": parts.tip.size,
                "chain": parts.tip.chain,
            }
            self._write_head(run_id, found, meta, parts.head)

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
                fragments = self._fragments(run_id, head.tip)
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

    def _fragments(self, run_id: str, tip: TranscriptTip) -> list[bytes] | None:
        """The messages ``tip`` was built from, or ``None`` if an object is missing."""
        if tip.length == 0:
            return []
        prefix = self._transcript_prefix(run_id)
        by_end: dict[tuple[int, str], tuple[int, str, str]] = {}
        for key in self._keys(prefix):
            try:
                start, end, before, after = key[len(prefix) :].split("-")
                by_end[(int(end), after)] = (int(start), before, key)
            except ValueError:
                continue  # not ours
        path: list[str] = []
        at = (tip.length, tip.chain[:HASH_DIGITS])
        genesis = snapshot_format.GENESIS[:HASH_DIGITS]
        while at != (0, genesis):
            link = by_end.get(at)
            if link is None or link[0] >= at[0]:
                return None
            path.append(link[2])
            at = (link[0], link[1])
        path.reverse()
        with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(path))) as pool:
            bodies = list(pool.map(self._get_object, path))
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
