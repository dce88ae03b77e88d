"""The broker seam: every place ratchet reaches into Celery's and kombu's internals.

Sending and receiving a turn's message go through Celery and kombu; where ratchet needs
more than their public API, the code that reaches in is here and nowhere else
(tests/test_import_rules.py holds the rest of the project to the public modules):

- :mod:`tasks.broker.next_turn` — the lean publish of the chained turn and the outbox
  entry pushed with the last checkpoint: Celery's message, byte for byte, without
  Celery's per-message work;
- :mod:`tasks.broker.transport` — ``ratchet-redis`` (kombu's Redis transport, its reads
  checked and its round trips fewer), its Sentinel form, the transport chosen by URL, and
  the app's ``amqp`` and ``events`` seams;
- :mod:`tasks.broker.unacked` — kombu's unacked bookkeeping on Redis, written on the
  BRPOP connection and read defensively;
- :mod:`tasks.broker.entries` — the check every queue entry gets where a channel reads it;
- :mod:`tasks.broker.embedded` — ``ratchet-filesystem``, the embedded default's broker;
- :mod:`tasks.broker.consumer` — Celery's consumer, setting aside what Celery refuses;
- :mod:`tasks.broker.compression` — kombu's codecs with bounded decoders.

Checked against celery 5.7.0 and kombu 5.7.0: upgrading either means reading this
package and the tests that hold it to their behaviour (tests/test_publish.py,
tests/crash/test_outbox.py, tests/test_redis_transport.py, tests/crash/test_broker_bookkeeping.py,
tests/test_message_checks.py, tests/test_compression.py). Nothing here is imported by this
file: an embedded worker loads no Redis transport.
"""
