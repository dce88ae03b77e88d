"""Agents and tools a newcomer can run: ``ratchet demo`` plays ``refund-desk.toml``."""
