"""The runtime's I/O: what the pure core (``runtime/``) decides on, reached.

- ``providers/``: the models, over HTTP (OpenAI-compatible, Anthropic) or from a script;
  each implements the core's :class:`runtime.provider.Provider`.
- ``mcp/``: MCP servers (subprocesses, streamable HTTP) and their tools.
- ``agent_files.py``: an agent file read from disk, its provider built, its tools loaded.
- ``tools.py``: a tool's module imported, the tool and its probe called.

Nothing here decides a run's fate: ``runtime`` does, with data this package hands it.
``runtime_io`` imports ``runtime`` and nothing else of ours; ``runtime`` never imports it
(tests/test_import_rules.py holds both).
"""
