"""The HTTP surfaces, each a translation onto ``agentrt.core``: OpenAI Chat Completions and
Completions (``openai``), Responses (``responses``), Anthropic Messages (``messages``); the session
routes are in ``agentrt/server.py`` with the app. No surface imports another (tests/test_layers.py)."""
