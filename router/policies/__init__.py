"""Routing policies, one per file; see ``router.policy`` for the interface and registry."""
