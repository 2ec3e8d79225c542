"""agentrt: a runtime that serves LLM agents. The client API is importable without the engine."""

from agentrt.client import (AgentRTError, APIConnectionError, APIStatusError, AsyncClient, AsyncSession,
                            AuthenticationError, BadRequestError, Client, ConflictError, InternalServerError,
                            NotFoundError, RateLimitError, Reply, RequestTooLargeError, Session, SessionInfo,
                            ToolCall, TurnDelta, Usage, tool_result)

__all__ = ["AgentRTError", "APIConnectionError", "APIStatusError", "AsyncClient", "AsyncSession",
           "AuthenticationError", "BadRequestError", "Client", "ConflictError", "InternalServerError",
           "NotFoundError", "RateLimitError", "Reply", "RequestTooLargeError", "Session", "SessionInfo",
           "ToolCall", "TurnDelta", "Usage", "tool_result"]
