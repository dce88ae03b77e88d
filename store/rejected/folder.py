"""Rejected messages of a ``filesystem://`` broker: one JSON file per entry in a folder."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.errors import RejectedEntryNotFound
from store.private import private_dir, read_no_follow, write_atomically
from store.rejected import (
    ENTRY_ID,
    MAX_ENTRIES,
    MAX_MESSAGE_BYTES,
    Rejected,
    RejectedStore,
    read_entries,
)


class FolderRejected(RejectedStore):
    """One ``<id>.json`` per entry; written to a temp file of an unpredictable name, then renamed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = f"the folder {folder}"

    def _ensure(self) -> None:
        private_dir(self.folder)
        if self.folder.is_symlink():
            # Entries are written into this folder: never into one someone pointed elsewhere.
            raise OSError(f"{self.folder} is a symlink; make it a plain directory")

    def add(self, entry: Rejected) -> None:
        self._ensure()
        write_atomically(self.folder, f"{entry.id}.json", entry.dumps().encode())
        names = self._names()
        for name in names[: max(0, len(names) - MAX_ENTRIES)]:
            (self.folder / name).unlink(missing_ok=True)

    def _names(self) -> list[str]:
        try:
            return sorted(
                n for n in os.listdir(self.folder) if n.endswith(".json") and ENTRY_ID.match(n[:-5])
            )
        except FileNotFoundError:
            return []

    def list(self, limit: int = 50) -> list[Rejected]:
        entries: list[Rejected] = []
        for name in reversed(self._names()):
            if len(entries) >= limit:
                break
            document = read_no_follow(self.folder / name, MAX_MESSAGE_BYTES + 1)
            if document is not None:
                entries.extend(read_entries([document]))
        return entries

    def get(self, entry_id: str) -> Rejected:
        if not ENTRY_ID.match(entry_id):
            raise RejectedEntryNotFound(entry_id)
        document = read_no_follow(self.folder / f"{entry_id}.json", MAX_MESSAGE_BYTES + 1)
        found = read_entries([document]) if document is not None else []
        if not found:
            raise RejectedEntryNotFound(entry_id)
        return found[0]

    def purge(self) -> int:
        count = 0
        for name in self._names():
            try:
                (self.folder / name).unlink()
                count += 1
            except FileNotFoundError:
                pass
        return count
