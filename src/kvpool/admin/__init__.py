"""``kvpool admin``: operating a cluster and its media (docs/operations.md, "Admin commands").

``cli`` (the subcommands, ``nodes``, ``stats``), ``namespaces`` (``invalidate``), ``drain``
(``drain`` / ``undrain``), ``verify`` (an SSD directory offline), ``common`` (config, nodes,
exit codes).
"""
