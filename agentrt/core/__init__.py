"""What every surface builds on: the one generation path (``generation``), session turns
(``turns``), the session store (``store``), tenants, KV leases and their TTLs (``leases``, ``affinity``)
and the API errors; the message conversion every surface shares is part of the generation path. Nothing here imports a surface (``agentrt.api``)."""
