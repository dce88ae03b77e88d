"""Shared fixtures. Real services only: each session starts its own redis-server."""

pytest_plugins = ("tests.redis_server", "tests.s3_server", "tests.workers", "tests.netns")
