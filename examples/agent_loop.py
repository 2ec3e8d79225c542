"""A small real agent on the session API: two local tools, tool call -> tool result -> reply.

    python examples/agent_loop.py --url http://127.0.0.1:8000 --folder examples/agent_files

The session lives on the server, so each turn sends only the new messages, and the
server's KV cache already holds everything before them: the per-turn line shows how
many prompt tokens were served from the cache.

SmolLM2-135M rarely decides to call a tool on its own, so by default the first step of a
task forces a call (``tool_choice="required"``, which the server enforces with a grammar)
and the answer after the tool result is plain text (``"none"``). Pass
``--tool-choice auto`` with a larger model.
"""

from __future__ import annotations

import argparse
import operator
import sys
from pathlib import Path

import agentrt

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}

DEFAULT_TASKS = ("What is 17 times 23?", "Read the file notes.txt: when is the team meeting?")


def tool_specs(files: list[str]) -> list[dict]:
    """The two tools. The file name is an enum of what the folder holds, so a call cannot miss."""
    calculator = {"type": "function", "function": {
        "name": "calculator", "description": "Compute `a op b` for two numbers.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "op", "b"],
                       "properties": {"a": {"type": "number"}, "op": {"type": "string", "enum": list(_OPS)},
                                      "b": {"type": "number"}}}}}
    read_file = {"type": "function", "function": {
        "name": "read_file", "description": "Read one text file from the user's folder.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["name"],
                       "properties": {"name": {"type": "string", "enum": files}}}}}
    return [calculator, read_file]


def run_tool(call: agentrt.ToolCall, folder: Path) -> str:
    """Run one tool call; errors go back to the model as the tool's result."""
    try:
        args = call.args()
        if call.name == "calculator":
            value = _OPS[args["op"]](float(args["a"]), float(args["b"]))
            return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
        if call.name == "read_file":
            path = (folder / str(args["name"])).resolve()
            if path.parent != folder.resolve() or not path.is_file():
                return f"error: no file named {args['name']!r}"
            return path.read_text(errors="replace")[:2000]
        return f"error: unknown tool {call.name!r}"
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        return f"error: {type(exc).__name__}: {exc}"


def report(turn: int, reply: agentrt.Reply) -> None:
    u = reply.usage
    share = 100.0 * u.cached_tokens / u.prompt_tokens if u.prompt_tokens else 0.0
    what = ", ".join(f"{c.name}({c.arguments})" for c in reply.tool_calls) or repr(reply.content)
    print(f"  turn {turn}: {u.prompt_tokens} prompt tokens, {u.cached_tokens} cached ({share:.0f}%), "
          f"{u.completion_tokens} generated -> {what}")


def solve(session: agentrt.Session, task: str, folder: Path, first_choice: str, max_steps: int,
          turn: int) -> int:
    print(f"user: {task}")
    reply = session.send(task, tool_choice=first_choice, parallel_tool_calls=False)
    turn += 1
    report(turn, reply)
    steps = 0
    while reply.tool_calls and steps < max_steps:
        results = [agentrt.tool_result(c.id, run_tool(c, folder)) for c in reply.tool_calls]
        for c, r in zip(reply.tool_calls, results):
            print(f"  tool {c.name} -> {r['content'][:80]!r}")
        choice = "auto" if first_choice == "auto" else "none"
        reply = session.send(results, tool_choice=choice, parallel_tool_calls=False)
        turn += 1
        steps += 1
        report(turn, reply)
    print(f"assistant: {reply.content}\n")
    return turn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--folder", type=Path, default=Path(__file__).parent / "agent_files")
    parser.add_argument("--tool-choice", default="required", choices=("required", "auto"),
                        help="for the first step of each task")
    parser.add_argument("--max-steps", type=int, default=3, help="tool rounds per task")
    parser.add_argument("--task", action="append", help="a task (repeatable); default: two examples")
    args = parser.parse_args(argv)

    files = sorted(p.name for p in args.folder.iterdir() if p.is_file())
    if not files:
        print(f"{args.folder} holds no files for read_file", file=sys.stderr)
        return 2
    with agentrt.Client(args.url, api_key=args.api_key) as client:
        session = client.sessions.create(
            system="You are a helpful assistant. Use the tools to answer, then answer in one sentence.",
            tools=tool_specs(files), sampling={"temperature": 0, "max_tokens": 64},
            metadata={"example": "agent_loop"})
        print(f"session {session.id}; tools: calculator, read_file over {args.folder} ({', '.join(files)})\n")
        try:
            turn = 0
            for task in args.task or DEFAULT_TASKS:
                turn = solve(session, task, args.folder, args.tool_choice, args.max_steps, turn)
            usage = session.refresh().usage
            print(f"session total: {usage.prompt_tokens} prompt tokens, {usage.cached_tokens} from the cache "
                  f"({100.0 * usage.cached_tokens / max(1, usage.prompt_tokens):.0f}%)")
        finally:
            session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
