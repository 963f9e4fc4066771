"""``metalctl``: operate the fleet from a terminal through metald's HTTP API.

Reads ``METALD_URL`` (default http://127.0.0.1:8080) and ``METALD_TOKEN``. Prints human tables
by default and the API's JSON with ``--json``. Exit status: 0 ok, 1 the API refused (its
problem+json detail is printed), 2 usage or connection errors.

Layout: ``client`` speaks HTTP (tokens, problem+json errors, the event stream), ``output``
prints (tables, JSON), and one module per resource registers its subcommands, each bound to its
handler with ``set_defaults(func=...)``; ``main`` builds the parser from those modules. A new
command goes into its resource's module (or a new module listed in ``main.RESOURCES``).
"""
