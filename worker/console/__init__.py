"""``ratchet console``: an operator's web console over :class:`worker.api.Ratchet`.

Needs ``pip install 'ratchet[console]'`` (Starlette, uvicorn, Jinja2). Nothing in
this package is imported by workers or by the rest of the CLI until the command runs.

- :mod:`worker.console.auth`     the token, sessions and CSRF tokens, the settings
- :mod:`worker.console.views`    what the pages show, read through the API
- :mod:`worker.console.actions`  answer, approve, deny, cancel, resume, reconcile
- :mod:`worker.console.app`      the Starlette app and its routes
- :mod:`worker.console.command`  the click command
"""
