"""The HTTP surfaces, each a translation onto ``agentrt.core`` with its routes (``routes(service, auth,
retry_after_s)``): OpenAI Chat Completions and Completions (``openai``), Responses (``responses``), Anthropic
Messages (``messages``) and server-side sessions (``sessions``); ``http`` is the plumbing they share (the
API-key check, replies once a generation is placed, server-sent events). No surface imports another
(tests/test_layers.py); ``agentrt/server.py`` builds the app and includes them."""
